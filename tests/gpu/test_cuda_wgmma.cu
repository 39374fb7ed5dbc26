/*
 * test_cuda_wgmma.cu -- Hopper's warpgroup products as the fast attention kernels use them
 * (src/ops/cuda/cuda_wgmma.cuh): kiln_cuda_wgmma_selfcheck's four operand forms (A from
 * registers or a SW128 tile, K-major and MN-major tiles) must give the exact products on a
 * compute-capability-9.0 device, so kiln_cuda_wgmma_usable is true there, and KILN_WGMMA=0
 * must turn it off. On other devices the check must answer "not there" (0), never a wrong
 * product. Prints "ALL OK" and exits 0; 1 with "FAILED"; 77 without a GPU.
 */
#include "ops/cuda/cuda_matmul.h"

#include <stdio.h>
#include <stdlib.h>

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        printf("FAILED (cudaGetDeviceProperties)\n");
        return 1;
    }
    int fails = 0;
    char msg[256];
    const int r = kiln_cuda_wgmma_selfcheck(msg, sizeof msg);
    const bool hopper = prop.major == 9 && prop.minor == 0;
    printf("%s (sm_%d%d): self-check %d%s%s\n", prop.name, prop.major, prop.minor, r,
           msg[0] ? ": " : "", msg);
    if (hopper && r != 1) {
        fprintf(stderr, "FAILED: the sm_90a products are not exact on this device\n");
        fails++;
    }
    if (!hopper && r != 0) {
        fprintf(stderr, "FAILED: a device without sm_90a code answered %d\n", r);
        fails++;
    }
    setenv("KILN_WGMMA", "0", 1);
    if (kiln_cuda_wgmma_usable(0)) {
        fprintf(stderr, "FAILED: KILN_WGMMA=0 left the wgmma kernels on\n");
        fails++;
    }
    unsetenv("KILN_WGMMA");
    if (kiln_cuda_wgmma_usable(0) != (hopper && r == 1)) {
        fprintf(stderr, "FAILED: kiln_cuda_wgmma_usable disagrees with the self-check\n");
        fails++;
    }
    if (fails) {
        printf("FAILED %d\n", fails);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
