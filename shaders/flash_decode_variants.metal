// Tile variants of the split-K decode kernel that the tuner times
// (torch_metal_flash/tuning, docs/tuning.md): the template of flash_decode.metal
// with half the keys per tile.  Every tile of torch_metal_flash/planner/decode.py
// that is not in flash_decode.metal must appear here (a test checks).
#define FLASH_DECODE_TEMPLATES_ONLY
#include "flash_decode.metal"

FLASH_DECODE_INSTANTIATE(f32, float, float, 64, 16)
FLASH_DECODE_INSTANTIATE(f32, float, float, 128, 8)
FLASH_DECODE_INSTANTIATE(f16, half, half, 64, 32)
FLASH_DECODE_INSTANTIATE(f16, half, half, 128, 16)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 64, 32)
FLASH_DECODE_INSTANTIATE(bf16, bfloat, bfloat, 128, 16)
