/* fuzz_gguf.c -- libFuzzer target for the GGUF reader: open arbitrary bytes, and when they
 * are accepted touch every kv (typed getters, array elements, strings) and every tensor
 * (bytes of its data, a dequantized block), so any table entry or pointer the reader lets
 * through that is not inside the input shows up under ASan. Seeds: tests/fuzz/corpus_gguf/. */
#include "formats/gguf.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static volatile uint64_t g_sink; /* keeps the reads from being optimized away */

static void touch_kv(const kiln_gguf *g, const kiln_gguf_kv *kv) {
    uint64_t h = kv->key.len;
    for (uint64_t i = 0; i < kv->key.len; i++) h = h * 31 + (uint8_t)kv->key.ptr[i];
    if (strlen(kv->key.ptr) != kv->key.len) abort(); /* keys are NUL-terminated copies */
    if (kiln_gguf_find(g, kv->key.ptr) != kv) abort(); /* keys are unique */
    uint32_t u32;
    int64_t i64;
    float f;
    int b, found;
    kiln_gguf_str s;
    (void)kiln_gguf_get_u32(g, kv->key.ptr, &u32, &found);
    (void)kiln_gguf_get_i64(g, kv->key.ptr, &i64, &found);
    (void)kiln_gguf_get_f32(g, kv->key.ptr, &f, &found);
    (void)kiln_gguf_get_bool(g, kv->key.ptr, &b, &found);
    if (kiln_gguf_get_str(g, kv->key.ptr, &s, &found) == KILN_OK && found)
        for (uint64_t i = 0; i < s.len; i++) h += (uint8_t)s.ptr[i];
    if (kv->type == KILN_GGUF_ARRAY) {
        for (uint64_t i = 0; i < kv->arr_len && i < 4096; i++) {
            h += (uint64_t)kiln_gguf_arr_i32(kv, i);
            float v = kiln_gguf_arr_f32(kv, i);
            uint32_t vb;
            memcpy(&vb, &v, 4);
            h += vb;
        }
        h += (uint64_t)kiln_gguf_arr_i32(kv, kv->arr_len); /* out of range: must return 0 */
        if (kv->arr_type == KILN_GGUF_STRING) {
            if (!kv->arr_strs && kv->arr_len) abort();
            for (uint64_t i = 0; i < kv->arr_len; i++) {
                kiln_gguf_str e = kiln_gguf_arr_str(kv, i);
                if (e.ptr != kv->arr_strs[i].ptr || e.len != kv->arr_strs[i].len) abort();
                for (uint64_t j = 0; j < e.len; j++) h += (uint8_t)e.ptr[j];
            }
        }
    }
    g_sink += h;
}

static void touch_tensor(const kiln_gguf *g, const kiln_tensor *t) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(t->dtype);
    if (!tr || t->n_dims < 1 || t->n_dims > KILN_MAX_DIMS) abort();
    if (kiln_gguf_find_tensor(g, t->name) != t) abort(); /* names are unique */
    uint64_t nbytes;
    if (!kiln_dtype_nbytes(t->dtype, (uint64_t)kiln_tensor_nelements(t), &nbytes) ||
        nbytes != t->nbytes)
        abort();
    const uint8_t *d = t->data;
    uint64_t h = 0;
    if (t->nbytes) h += d[0] + d[t->nbytes - 1]; /* first and last byte are inside the input */
    float block[256];
    kiln_dequantize_block(t->dtype, d, block);
    for (int i = 0; i < tr->block_size; i++) {
        uint32_t vb;
        memcpy(&vb, &block[i], 4);
        h += vb;
    }
    g_sink += h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kiln_gguf *g = NULL;
    if (kiln_gguf_open_memory(data, size, "fuzz", &g) != KILN_OK) {
        if (g) abort(); /* output untouched on failure */
        return 0;
    }
    g_sink += kiln_gguf_version(g) + kiln_gguf_alignment(g);
    for (int64_t i = 0; i < kiln_gguf_n_kv(g); i++) touch_kv(g, kiln_gguf_kv_at(g, i));
    for (int64_t i = 0; i < kiln_gguf_n_tensors(g); i++) touch_tensor(g, kiln_gguf_tensor_at(g, i));
    (void)kiln_gguf_find(g, "general.architecture");
    (void)kiln_gguf_find_tensor(g, "token_embd.weight");
    kiln_gguf_close(g);
    return 0;
}
