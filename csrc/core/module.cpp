// The core as a module of its own (Linux, and macOS without the Metal
// launcher): torch_metal_flash/native/build.py builds it at first use.  On macOS
// torch_metal_flash._C binds the same core next to the Metal encoder.
#include "bridge.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_metal_flash C++ op core (no Metal encoder)";
  tmf::bind_core(m);
}
