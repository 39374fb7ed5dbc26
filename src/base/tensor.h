/*
 * tensor.h -- the tensor view every layer shares, and per-dtype facts.
 *
 * A kiln_tensor is a view of contiguous data it does not own (a mapped file, or an arena).
 * Shapes are outermost first, as torch prints them: a weight matrix W (rows R = out
 * features, cols C = in features) has shape {R, C} and row r is the C contiguous values
 * (or C/block_size quantized blocks) W[r, :]. GGUF's ne[] order is reversed on read.
 */
#ifndef KILN_TENSOR_H
#define KILN_TENSOR_H

#include "base.h"

#define KILN_MAX_DIMS 4

typedef struct kiln_tensor {
    const char *name;             /* owned by whoever owns the tensor table */
    kiln_dtype dtype;
    int n_dims;                   /* 1..KILN_MAX_DIMS */
    int64_t shape[KILN_MAX_DIMS]; /* outermost first; unused dims are 1 */
    const void *data;             /* contiguous, row-major in shape order */
    size_t nbytes;
} kiln_tensor;

typedef struct kiln_dtype_traits {
    const char *name;   /* "f32", "q4_k", ... */
    int block_size;     /* elements per block (1 for plain types) */
    int type_size;      /* bytes per block */
    int is_quantized;
} kiln_dtype_traits;

/* Traits of t, or NULL for a value out of range. */
const kiln_dtype_traits *kiln_dtype_get_traits(kiln_dtype t);

/* Bytes of n elements of type t, via *out; false when n is not a multiple of the block size
 * or the product overflows. */
bool kiln_dtype_nbytes(kiln_dtype t, uint64_t n, uint64_t *out);

/* Number of elements (product of the shape). */
static inline int64_t kiln_tensor_nelements(const kiln_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= t->shape[i];
    return n;
}

/* Convert one element. Exact conversions (f16/bf16 -> f32 widen exactly). */
float kiln_fp16_to_fp32(uint16_t h);
float kiln_bf16_to_fp32(uint16_t b);
uint16_t kiln_fp32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
uint16_t kiln_fp32_to_fp16(float f); /* round to nearest even */

/* Dequantize n elements (n a multiple of the type's block size) of type t from src to f32,
 * with exactly the bits gguf-py's dequantize gives. Plain types (f32/f16/bf16) widen. */
void kiln_dequantize(kiln_dtype t, const void *src, float *dst, int64_t n);

/* Dequantize exactly ONE block of type t (block_size elements of dst; for plain types one
 * element) with the same bits as kiln_dequantize. For the matmul hot loop; block need not be
 * aligned. Over a run of blocks (a row), one kiln_dequantize call is faster (no per-block
 * dispatch). */
void kiln_dequantize_block(kiln_dtype t, const void *block, float *dst);

#endif /* KILN_TENSOR_H */
