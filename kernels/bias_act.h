// Bias + ReLU around the cuBLAS GEMMs of the MLP (forward), and the ReLU
// mask + bias gradient (backward).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/views.h"

namespace qstream::kernels {

// y[r][c] = act(y[r][c] + bias[c]), act = ReLU or identity.
// Grid-stride over rows*cols, one element per thread step.
cudaError_t LaunchBiasActivation(Matrix y, const float* bias, bool relu, cudaStream_t stream);

// Backward of y = act(x W^T + b) given dy (rows x cols, in place) and the
// forward output `activation` (same shape; nullptr = identity, no mask):
//   dy[r][c] *= (activation[r][c] > 0);   db[c] = sum_r dy[r][c].
// Grid: one block per 32 columns, block (32, 32): thread (x, y) sums rows
// y, y+32, ... of column x in order, then thread y == 0 adds the 32 partials
// in order and alone writes db[c]. No atomics.
cudaError_t LaunchActivationBackwardBiasGrad(Matrix dy, const float* activation, float* bias_grad,
                                             cudaStream_t stream);

}  // namespace qstream::kernels
