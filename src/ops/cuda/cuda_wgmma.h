/*
 * cuda_wgmma.h -- whether the fast-mode kernels may take Hopper's warpgroup products
 * (cuda_wgmma.cuh) on the current device. C++ linkage.
 *
 * The wgmma kernels exist in the sm_90a machine code only. kiln_cuda_wgmma_usable is true
 * when the binary the runtime loaded for this device is that code and its products passed
 * kiln_cuda_wgmma_selfcheck (every operand form the kernels use, against exact integer
 * products) on this device; the answer is cached per device after the first call, which
 * must not be made while a stream is capturing a graph (the backend calls it at create).
 * KILN_WGMMA=0 in the environment turns the wgmma kernels off (read on every call: the tests
 * switch it), so every caller keeps its mma.sync path.
 */
#ifndef KILN_CUDA_WGMMA_H
#define KILN_CUDA_WGMMA_H

#include <cuda_runtime.h>
#include <stddef.h>

/* 1: the four operand forms (A from registers or a tile, each of K-major and MN-major tiles)
 * gave the exact products; 0: this binary has no sm_90a code for the device (or the device
 * is not compute capability 9.0): the wgmma kernels are not there; -1: a mismatch or a CUDA
 * error, described in msg (cap bytes). Synchronous: runs one small kernel on stream 0. */
int kiln_cuda_wgmma_selfcheck(char *msg, size_t cap);

/* Whether the fast kernels take their wgmma variants on the current device (see above). The
 * first call on a device runs the self-check, unless stream s is capturing a graph: then it
 * answers false and leaves the question open. */
bool kiln_cuda_wgmma_usable(cudaStream_t s);

#endif /* KILN_CUDA_WGMMA_H */
