// Tile variants of the forward kernel that the tuner times (torch_metal_flash/tuning,
// docs/tuning.md): instantiations of the template of flash_fwd.metal with other
// tile sizes.  They live in their own file so that the library of the default
// tiles does not grow with the tuning space.  Every tile of
// torch_metal_flash/planner/tiles.py that is not in flash_fwd.metal must appear
// here (a test checks).
#define FLASH_FWD_TEMPLATES_ONLY
#include "flash_fwd.metal"

FLASH_FWD_INSTANTIATE(bf16, bfloat, 64, 32, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 64, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 80, 16, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 80, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 96, 16, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 96, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 128, 32, 16)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 128, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 160, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 160, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 192, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 192, 64, 32)
FLASH_FWD_INSTANTIATE(bf16, bfloat, 256, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(bf16, bfloat, 256, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 64, 32, 32)
FLASH_FWD_INSTANTIATE(f16, half, 64, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 80, 16, 32)
FLASH_FWD_INSTANTIATE(f16, half, 80, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 96, 16, 32)
FLASH_FWD_INSTANTIATE(f16, half, 96, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 128, 32, 16)
FLASH_FWD_INSTANTIATE(f16, half, 128, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 160, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 160, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 192, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 192, 64, 32)
FLASH_FWD_INSTANTIATE(f16, half, 256, 32, 16)
FLASH_FWD_INSTANTIATE_SHARED(f16, half, 256, 64, 32)
FLASH_FWD_INSTANTIATE(f32, float, 64, 64, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 80, 64, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 96, 64, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 128, 64, 32)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 160, 64, 16)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 192, 64, 16)
FLASH_FWD_INSTANTIATE_SHARED(f32, float, 256, 64, 16)
