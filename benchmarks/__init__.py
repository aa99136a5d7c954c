"""Benchmarks of wt_callbacks (a package so the receiver can import model factories from it)."""
