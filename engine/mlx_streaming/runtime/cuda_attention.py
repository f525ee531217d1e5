"""Attention of a few query positions on MLX's CUDA backend, without a cuDNN graph built per key length.

There MLX computes an attention whose query has more than one position with cuDNN and keeps one cuDNN graph per
exact shape of queries, keys and values; building one took 41-67 ms on an H100 (MLX 0.32.4), running a cached
one 0.1-0.3 ms. A speculative verify (K positions) and the MTP head's feed after it meet a key length never seen
before at every step, so every such step paid a build or two: fixed K=4 at the default model's 25% pool ran at
46 tok/s, and at 104 tok/s with cuDNN's attention off, where MLX computes it with its own kernels (a first use
compiles them once; no build per shape). The trade: a decode step of one position past 256 keys, which MLX gives
to cuDNN (one graph per 256 keys), runs MLX's own kernel, as it does below 256. MLX reads
``MLX_CUDA_USE_CUDNN_SDPA`` once, at the process's first attention (set after one, it changed nothing in a probe
on the H100), so the switch is set when a model with an MTP head is built, before it computes; a user's own
value is kept.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

#: MLX's switch for its cuDNN attention (1: on, MLX's default).
CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"


def avoid_graph_per_shape() -> bool:
    """On MLX's CUDA backend, where the user has not set ``CUDNN_ATTENTION``, turn MLX's cuDNN attention off for
    this process and say so on stderr, once (it takes effect where no attention has run in the process yet).
    Returns whether this call turned it off."""
    if not mx.cuda.is_available() or CUDNN_ATTENTION in os.environ:
        return False
    os.environ[CUDNN_ATTENTION] = "0"
    print(f"mlx-streaming: {CUDNN_ATTENTION}=0 (MLX reads it at the process's first attention): its CUDA backend "
          f"builds a cuDNN graph (about 50 ms) for each new shape of a speculative verify's attention; set "
          f"{CUDNN_ATTENTION} yourself to choose otherwise", file=sys.stderr, flush=True)
    return True
