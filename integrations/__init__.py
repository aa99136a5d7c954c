"""Thin adapters, one module per outside framework (installed as ``wt_callbacks.integrations``)."""
