"""The shapes, batch sizes, contexts and sweeps of bench_attention (shared by its modules)."""
import torch

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)
K_DRAFT, DRAFT_EXTEND = 8, 6  # tree verify tokens; EAGLE steps (5) + 1
SPEC_BATCHES, SPEC_CONTEXTS = (1, 8, 32), (512, 4096)
SWEEP_CASES = ((1, 512), (8, 512), (1, 4096), (8, 4096), (32, 4096), (128, 4096), (1, 32768),
               (8, 32768))
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_TILES = ((64, 2, 4), (32, 2, 4), (64, 3, 4), (128, 2, 8))  # (BLOCK_N, stages, warps)
# --grid: (BLOCK_N, stages, warps) x split counts, each point in a graph of 20 calls
GRID_TILES = tuple((n, s, w) for n in (16, 32, 64) for s in (1, 2, 3) for w in (1, 2, 4))
GRID_SPLITS = (2, 4, 8, 16)
MAX_SETS = 8
SMOKE = dict(batches=(1, 3), contexts=(40, 100), spec_batches=(2,), spec_contexts=(50,),
             sweep=((2, 100),), splits=(1, 3), tiles=((64, 2, 4),))
