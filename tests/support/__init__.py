"""What only the tests and the benches use: the case matrices and problem builders
(``forward_cases``, ``backward_cases``, ``precision_cases``, ``varlen_cases``, ``kvcache_cases`` with
the independent float64 implementation ``kvcache_oracle``, ``ring_cases``: ring attention's
problems and a process group of spawned gloo processes, ``fuzz_problems``: whole problems of
every face, needs hypothesis), ``portable`` (``torch.randn_like`` / ``Tensor.normal_`` through
the oracle's machine-independent ``randn``) and test helpers (``host_syncs``, ``tensor_layouts``).
The acceptance rule itself ships with the package (``torch_metal_flash.testing``).

Imported as ``from support import forward_cases`` (pytest puts tests/ on sys.path for its
conftest; bench/harness.py does the same for the benches)."""
