/* fuzz_safetensors.c -- libFuzzer target: any bytes as a .safetensors file. Every tensor that
 * opens is read end to end (so ASan sees any pointer outside the buffer) and looked up by
 * name. */
#include "formats/safetensors.h"

#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kiln_safetensors *st = NULL;
    if (kiln_safetensors_open_memory(data, size, "fuzz", &st) != KILN_OK) return 0;
    int64_t n = kiln_safetensors_n_tensors(st);
    volatile uint8_t sink = 0;
    for (int64_t i = 0; i < n; i++) {
        const kiln_tensor *t = kiln_safetensors_tensor_at(st, i);
        const uint8_t *p = t->data;
        for (size_t k = 0; k < t->nbytes; k++) sink ^= p[k];
        if (kiln_safetensors_find(st, t->name) != t) __builtin_trap();
        if (t->n_dims < 1 || t->n_dims > KILN_MAX_DIMS) __builtin_trap();
    }
    (void)sink;
    kiln_safetensors_close(st);
    return 0;
}
