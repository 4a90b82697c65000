// Tile variants of the backward kernels that the tuner times (torch_metal_flash/tuning,
// docs/tuning.md): the dQ and dK/dV templates of flash_bwd.metal with half-height
// owned blocks.  Every tile of torch_metal_flash/planner/backward_tiles.py that is
// not in flash_bwd.metal must appear here (a test checks).
#define FLASH_BWD_TEMPLATES_ONLY
#include "flash_bwd.metal"

FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 64, 32, 32)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 128, 32, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 64, 32, 32)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 128, 32, 32)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 64, 32, 32)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 128, 32, 16)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 64, 32, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 128, 32, 32, 1)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 128, 32, 32, 2)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 64, 32, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 128, 32, 32, 1)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 128, 32, 32, 2)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 64, 32, 32, 0)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 128, 32, 16, 1)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 128, 32, 16, 2)

// the wide head dims (384, 512)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 384, 16, 8)
FLASH_BWD_DQ_INSTANTIATE(f32, float, 512, 16, 8)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 384, 16, 8)
FLASH_BWD_DQ_INSTANTIATE(f16, half, 512, 16, 8)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 384, 16, 8)
FLASH_BWD_DQ_INSTANTIATE(bf16, bfloat, 512, 16, 8)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 384, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 384, 16, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 512, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(f32, float, 512, 16, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 384, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 384, 16, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 512, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(f16, half, 512, 16, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 384, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 384, 16, 8, 2)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 512, 16, 8, 1)
FLASH_BWD_DKV_INSTANTIATE(bf16, bfloat, 512, 16, 8, 2)
