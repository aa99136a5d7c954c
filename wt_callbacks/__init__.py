"""wt_callbacks: keep vLLM servers serving the weights your trainer produces.

The core (this package) imports torch and requests only. Framework adapters
live in ``wt_callbacks.integrations``.
"""

__version__ = "0.1.0"
