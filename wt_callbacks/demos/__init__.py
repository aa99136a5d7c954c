"""Demo and test helpers, used alike by the tests, the examples and the benchmarks.

As ``lightning.pytorch.demos``: small things that run offline and are handy
to try the library or to test against it, importable wherever the package is
installed (a receiver subprocess loads its model factory from here):

* ``toy_task``: a tiny causal LM and a task it learns in a minute on a CPU
  (``python -m wt_callbacks.demos.toy_task DIR`` writes the model).
* ``models``: small deterministic ``nn.Module`` s for receivers and tests.
* ``tiny_lms``: tiny causal LMs of the families RL users train (MoE, tied, ...).
* ``synthetic_llama``: Llama-shaped weights of any size, for benchmarks.
* ``receiver_process``: the reference receiver in a child process, and its checksums.
* ``full_weights``: a trainer's full weights under any sharding scheme, gathered
  independently of the weight sources (what a receiver must hold).
* ``memory``: what a block of code adds to the peak resident memory.
* ``deepspeed_cpu``: DeepSpeed on a CPU-only host without its shared-memory op build.
* ``multiprocess``: a free port, leaving a process group together.
* ``vllm_server``: a real vLLM server (from a separate venv) in a child process.
"""
