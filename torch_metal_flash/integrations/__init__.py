"""Integrations with other libraries.  Each submodule imports its library lazily
(only when used), so none of them is a dependency of torch_metal_flash:

* :mod:`torch_metal_flash.integrations.transformers`: the ``"metal_sdpa"``
  attention implementation for Hugging Face transformers (5.x).
"""
