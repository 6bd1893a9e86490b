"""Measured tuning constants, in one place (the evidence behind each is in docs/performance.md).

Code reads them as ``tuning.NAME`` at call time, so ``pyengine bench tuning`` can sweep one value in a running
process. None of them changes a result beyond float rounding: they only choose between equivalent code paths
(the S14 back-off's choose draft lengths, and verification keeps the output exact whatever they choose).
"""
from __future__ import annotations

import sys

WASM = sys.platform == "emscripten"   # the one runtime switch: Pyodide's NumPy (no BLAS, no SIMD) picks other paths

# --- BLAS threads (engine/threads.py) ---------------------------------------------------------------------
DEFAULT_THREADS_MAX = 1     # default BLAS threads at most this many (the usable cores, fewer when busy): one thread
#                             decoded faster than two on this machine class even when quiet (1 vs 2 threads: 49.5
#                             vs 38 tok/s single-stream, 330 vs 267 at 32 sequences) and is 12-137x faster to a first
#                             token when the cores are busy (docs/performance.md "BLAS threads")
THREADS_IDLE_SAMPLE_S = 0.05  # /proc/stat sampled this long at startup to count the idle cores
THREADS_IDLE_SLACK = 0.25   # a core counts as free when at least 75% idle over the sample

# --- linear layers (layers/linear.py) -------------------------------------------------------------------
LINEAR_ROW_LOOP_MAX = 8     # 2..8 rows: matvecs (rows after the first read the weight from cache) beat one sgemm
#                             (plain (in, out) arrays: MoE experts; resident DenseLinear uses column blocks)
SMALL_GEMM_ROWS = 17        # DenseLinear's column blocks keep up to 17 rows (k = 16 drafts + 1) in the small kernel
#                             (more rows: one packed sgemm per block)
SMALL_GEMM_CHUNK_MIN = 24   # from 24 rows (below REGROUP_MIN_ROWS) row chunks of <= 17 in the small kernel beat one
#                             packed sgemm per block: 24 rows 1.10x, 32 1.40x, 64 1.30x, 128 1.24x; 18-20 rows 0.87-0.94x
#                             (and below 24 wherever one product passes SMALL_GEMM_MNK: 21-23 rows x 1536 inputs 1.5x)
REGROUP_MIN_ROWS = 256      # from 256 rows (prefill) blocks are copied back in 1024-column groups for one sgemm each:
REGROUP_COLS = 1024         # 512 rows, one layer: 38.1 ms vs 40.6 per block vs 36.5 whole matrix; 128 rows: no gain
RESIDENT_LAYOUT = "rows" if WASM else "column-blocks"
#                             how a resident DenseLinear holds its matrix: column blocks for OpenBLAS's small kernel
#                             (CPython), or the GGUF's (out, in) rows multiplied one input row at a time by
#                             np.einsum("oi,i->o") (Pyodide: NumPy without BLAS; its einsum loop is 3.1-4.6x the
#                             column blocks' matmul for one row: docs/performance.md, "Pyodide resident layout")
RESIDENT_STAGE_BYTES = (512 << 10) if WASM else 0
#                             rows layout: each L2-sized block of rows is copied into the weights scratch and
#                             multiplied there; in Pyodide the scalar einsum reads memory at ~1.0 ns a float32
#                             weight, NumPy's contiguous copy at 0.4-0.6, and copy + einsum in cache cost 0.74
#                             (3072x576 / 576x1536 / 49152x576 from memory; docs/performance.md, "Pyodide resident:
#                             staged blocks"); 0: the held rows are multiplied in place
SMALL_GEMM_MNK = 1_000_000  # OpenBLAS's small-matrix kernel takes M*N*K <= 100^3 (beyond: packed sgemm, 3x slower
#                             for 9 rows of a 576 x 3072 block product; bit-identity across row counts ends there)
LEAN_ROW_LOOP_MAX = 12      # lean: matvecs over the just-dequantized rows beat one product up to ~12 rows
LEAN_BLOCK_BYTES = 512 << 10  # S21 lean: float32 rows unpacked per block (L2-sized): 2048-input Q4 rows, 1 token,
#                               64 rows 5.5 ms vs 32 rows 6.5 / 128 rows 6.1 per 5632 rows (docs/performance.md; 1 MiB
#                               makes the region streams' products 5-15% faster but not a whole decode token, within
#                               noise, and costs 2.8 MiB of the 1.1B shape's 64 MiB)
LEAN_SCALE_BLOCKS = 16       # S21 lean: block scales decoded for 16 row blocks at once (~1 MiB of (rows, groups)
#                               float32 scales and mins; per row block they cost 3.4 of 9 ms for 5632 Q4_K rows)
LEAN_FOLD_MAX_ROWS = 8        # S21 lean: up to this many input rows fold the block scales into the activations
#                               (per-group batched products); more rows scale the block in place and take one sgemm
# S21 lean in Pyodide: NumPy in wasm runs integer operations on bytes without SIMD (1 MiB of uint8 `& 15`: 0.26
# CPU ms, the same bytes as uint64 lanes: 0.06 ms); CPython's NumPy does bytes with SIMD as fast as lanes (0.45 ms
# both, memory-bound) and keeps the two-operation byte form (lanes need a third, a mask).
LEAN_LANE_BYTES = 8 if WASM else 1   # decode streams unpack nibbles in lanes of this many bytes
LEAN_LAYOUT = "bytes" if WASM else "stream"   # Q4_0 / Q4_1 lean parts: unpacked once into a byte a weight
#                               and cast a row block at a time (layers/wasm_lean.py; Pyodide, SmolLM2 1536x576, CPU
#                               ns a weight over 40 matrices: stream 2.72, bytes 1.13), or the file's bytes (CPython)
LEAN_STREAM_REGIONS = not WASM   # S21 lean, CPython: decode streams unpacked by 1-D operations on whole regions of
#                               a row block (NumPy's SIMD loops; on 2-D views of the rows ~4x slower): 5632 x 2048,
#                               one row, CPU ms, same run, alternated: Q6_K 17.0 / 18.2 -> 13.1 / 13.8 (its unpacking
#                               9.3 -> 4.2, quants_stream._q6_k_pairs); Q4_K's nibbles 1.4 -> 0.9
LEAN_STREAM_MAX_ROWS = 1      # S21 lean: one input row (decode) multiplies the decode streams of LEAN_STREAM_TYPES
LEAN_STREAM_TYPES = ("Q4_K", "Q6_K", "Q4_0", "Q4_1")  # (gguf/quants_stream.py: whole-row unpacking, x in stream
#                               order): 5632 x 2048, CPU ms folded -> stream, same run: Q4_K 9.3 -> 7.2, Q6_K 23.8 ->
#                               19.8, Q4_0 10.9 -> 9.8; Q8_0 6.7 = 6.8 (stays folded); 8 rows: folded 1.3-1.6x faster

# --- attention (layers/attention.py, layers/paged_attention.py) ----------------------------------------
DECODE_SLOTS = 2048         # padded context slots per batched decode group: its K and V stay in cache
DECODE_KEY_CHUNK = 256      # keys per matmul for few queries (OpenBLAS's unpacked kernel stops at ~400 keys)
KEY_TREE_MIN = 256          # key counts from which the halving reduction beats NumPy's axis reduction,
KEY_TREE_MAX_ROW = 256      # for rows shorter than this (a flash tile's 384-float rows reduce well as they are)
SHORT_QUERY_MAX = 16        # sequences with at most this many new tokens are batched like decodes
FLASH_MIN_QUERY = 128       # queries from which prefill attention is tiled (bounded scratch)
FLASH_TILE = 256            # keys per flash tile
FLASH_Q_TILE = 128          # queries per flash tile
KV_TILE_SLOTS = 1024        # stored (fp16 / q8_0 / q4_0) K/V slots cast per tile: <= 1 MiB float32, in L2

# --- S11 chunk budget from a target ITL (engine/chunk_budget.py) -----------------------------------------
TARGET_ITL_DECODE_MULT = 2.5  # derived target before ITL_SPREAD_MIN_STEPS chunk steps are measured: 2.9 / (1 + 16%)
ITL_GOAL_MULT = 2.9           # derived target x (1 + spread): issue 19's 3x p99/median, less 3% for the median's error
ITL_SPREAD_QUANTILE = 1.0     # spread: the largest time / predicted - 1 of the kept chunk steps (0.95 let bursts by)
ITL_SPREAD_MIN_STEPS = 8      # chunk steps measured before the spread replaces the prior multiplier
TARGET_ITL_MIN_MULT = 2.0     # a very noisy host lowers the derived target to no less than 2x the decodes' step
CHUNK_MIN_TOKENS = 16         # a prompt's least chunk a step (one block; at 2.6k context it adds 1.2 decode steps)
CHUNK_GROWTH = 2.0            # trust region: a chunk <= 2 x the largest one measured (the model is linear)
STEP_COST_WINDOW = 32         # measured steps kept per kind (decode-only, with chunks)
STEP_COST_HALF_LIFE = 16.0    # steps: the weight of a measurement halves (follows the host's speed drift)
STEP_COST_RIDGE = 1e-3        # ridge on unit-scaled features: only breaks ties between collinear ones

# --- captured steps (engine/graph_replay.py, S13) --------------------------------------------------------
GRAPH_CACHE_STEPS = 32      # buckets kept per runner: a batch's buckets change with its block counts, ~every
#                             16 tokens per sequence; 32 small op lists (SmolLM2: ~1400 calls each) cost a few MB

# --- S14 speculative decoding's back-off (engine/spec_decode.py) ------------------------------------------
# Cost of a step whose decodes carry k drafts each, relative to a plain decode step, until it is measured:
# at or below the real cost on purpose (a single-stream verification of k drafts costs ~1 + 0.12 k forwards with
# the column-block matrices; bench linear --forward), so that every k is tried once and then priced by its
# measured step time
PRIOR_COST = 0.1
ALPHA_PRIOR = 0.6          # acceptance assumed before a sequence has any evidence (prior drafts are tried)
ALPHA_WEIGHT = 0.15        # weight of one accept/reject trial in the per-sequence average (~7 trials of memory)
TIME_DRIFT = 0.05          # a step-time estimate is min(sample, estimate * 1.05): it follows slowdowns in ~15 samples
REMEASURE_AFTER = 32       # steps after which an unused draft length's cost is taken halfway back to the prior
PROBE_GAP = 8              # an expensive proposer backed off to k=0 drafts 1 token after 8 steps, then after
PROBE_GAP_MAX = 256        # twice as many steps after each probe that did not pay (up to 256)
MIN_GAIN = 1.1             # draft only for an expected 10% more tokens per unit of cost: alpha and cost are noisy
                           # estimates, selected when they look high (bench spec, 8 chat sequences: 0.91x with none)
PROBE_MIN_GAIN = 1.2       # ... probe only when always-accepted drafts would make decoding at least 1.2x faster
BASELINE_EVERY = 64        # one forced plain decode step in 64 keeps cost(0) measured (~1.5% of the steps)

# --- S18 disaggregation (pyengine/disagg/; evidence in docs/disaggregation.md) ----------------------------
# One host usually has fewer cores than ranks + their client: when they compete, the decode rank and the router
# (the latency targets: ITL, token delivery) should get the core, the prefill rank (throughput work) give it up.
PREFILL_NICE = 5             # niceness of prefill ranks: 5 steps is 1/3 of the CPU weight (Linux CFS);
#                              $PYENGINE_PREFILL_NICE overrides it (0: prefill competes as an equal, the A/B's other arm)
TRANSFER_WINDOW = 32         # block messages in flight to one decode instance: at least what it takes between two
#                              steps (a quarter-step budget: ~20 float32 SmolLM2 blocks of 0.74 MB on a loaded host); a
#                              sleeping prefill rank refilled a window of 8 too rarely (transfers 2.81 s vs 0.33-0.67)
OFFER_WAIT_S = 1.0           # no new prefill step while an offer waits this long for its answer (about one decode
#                              step on a loaded host; a prefill step started meanwhile would hold the answer for seconds)
# Adoption between two decode steps: checking + writing a block runs at ~0.7 GB/s (SmolLM2 float32: 0.74 MB a block,
# ~1 ms). A turn may spend ADOPT_STEP_SHARE of the last decode step on blocks (at least ADOPT_BUDGET_S): the running
# decodes' ITL grows by at most that share while a prompt arrives, on a quiet host (40 ms steps: 10 ms, ~10 blocks)
# as on a loaded one (0.26 s steps took 2.1 s per 26-block transfer with a fixed 10 ms budget).
ADOPT_BUDGET_S = 0.010
ADOPT_STEP_SHARE = 0.25
ADOPT_BLOCKS_PER_POLL = 256  # block messages taken in one turn at most (the time budget ends a turn first)

SWEEPABLE = ("LINEAR_ROW_LOOP_MAX", "LEAN_ROW_LOOP_MAX", "DECODE_SLOTS", "DECODE_KEY_CHUNK",
             "KEY_TREE_MIN", "SHORT_QUERY_MAX")
