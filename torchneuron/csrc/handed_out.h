// handed_out.cpp's interface: a queued kernel allocating its results in the device memory its launch handed out.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace torchneuron {

// Runs `kernel` on this thread with the CPU allocator handing each block of `blocks` (of `bytes`) to the first
// allocation of its exact size the kernel makes here, so a result it makes there needs no copy. The caller checks
// where each result is (a kernel may ask for a size first for scratch, or make one result in another's block), then
// drops the kernel's tensors and calls check_handed_out_released. Only for ATen's own kernels (see handed_out.cpp).
void with_handed_out(const std::vector<void*>& blocks, const std::vector<size_t>& bytes,
                     const std::function<void()>& kernel);

// Which of `blocks` holds `t`'s storage (-1: none, or `t` undefined): where a kernel made a result.
int block_of(const at::Tensor& t, const std::vector<void*>& blocks);

// Raises if a block the kernel `name` was handed is still held once its tensors are dropped: something kept a
// tensor it made past its call (a cache), which would alias device memory the runtime reuses.
void check_handed_out_released(const std::vector<void*>& blocks, const char* name);

}  // namespace torchneuron
