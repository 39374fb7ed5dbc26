/*
 * gguf.h -- GGUF v2/v3 reader (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
 *
 * kiln_gguf_open validates the whole file before returning: magic, version, counts against
 * the file size, every string length, every value type, array lengths and element sizes
 * (checked arithmetic), tensor n_dims <= 4, every dim >= 1, element and byte counts that do
 * not overflow, tensor types known, sizes a multiple of the block size, offsets aligned,
 * data inside the file, tensors not overlapping, duplicate tensor names or keys refused.
 * Every error names the file and the byte offset or key or tensor.
 */
#ifndef KILN_GGUF_H
#define KILN_GGUF_H

#include "../base/tensor.h"

typedef enum kiln_gguf_type {
    KILN_GGUF_UINT8 = 0,
    KILN_GGUF_INT8 = 1,
    KILN_GGUF_UINT16 = 2,
    KILN_GGUF_INT16 = 3,
    KILN_GGUF_UINT32 = 4,
    KILN_GGUF_INT32 = 5,
    KILN_GGUF_FLOAT32 = 6,
    KILN_GGUF_BOOL = 7,
    KILN_GGUF_STRING = 8,
    KILN_GGUF_ARRAY = 9,
    KILN_GGUF_UINT64 = 10,
    KILN_GGUF_INT64 = 11,
    KILN_GGUF_FLOAT64 = 12,
} kiln_gguf_type;

/* A string inside the mapped file: NOT NUL-terminated. */
typedef struct kiln_gguf_str {
    const char *ptr;
    uint64_t len;
} kiln_gguf_str;

typedef struct kiln_gguf_kv {
    kiln_gguf_str key;
    kiln_gguf_type type;      /* value type; for arrays, ARRAY */
    kiln_gguf_type arr_type;  /* element type when type == ARRAY */
    uint64_t arr_len;         /* elements when type == ARRAY */
    const uint8_t *value;     /* points into the file at the value (after type/len fields) */
    /* for arrays of strings: offsets are walked with kiln_gguf_arr_str() */
    const kiln_gguf_str *arr_strs; /* when arr_type == STRING: arr_len entries (owned) */
} kiln_gguf_kv;

typedef struct kiln_gguf kiln_gguf;

/* Open and validate; the file is mapped (use_mmap) or read. */
kiln_status kiln_gguf_open(const char *path, int use_mmap, kiln_gguf **out);
/* Same, over a caller-owned buffer that must outlive the handle (fuzzing, tests). */
kiln_status kiln_gguf_open_memory(const uint8_t *data, size_t size, const char *label,
                                  kiln_gguf **out);
void kiln_gguf_close(kiln_gguf *g);

uint32_t kiln_gguf_version(const kiln_gguf *g);
uint32_t kiln_gguf_alignment(const kiln_gguf *g);

/* Metadata. find returns NULL when absent. */
int64_t kiln_gguf_n_kv(const kiln_gguf *g);
const kiln_gguf_kv *kiln_gguf_kv_at(const kiln_gguf *g, int64_t i);
const kiln_gguf_kv *kiln_gguf_find(const kiln_gguf *g, const char *key);

/* Typed getters: KILN_ERR_FORMAT if the key exists with another type (message names the
 * key); *found = 0 and *out untouched when absent. Integer getters accept any integer type
 * whose value fits. */
kiln_status kiln_gguf_get_u32(const kiln_gguf *g, const char *key, uint32_t *out, int *found);
kiln_status kiln_gguf_get_i64(const kiln_gguf *g, const char *key, int64_t *out, int *found);
kiln_status kiln_gguf_get_f32(const kiln_gguf *g, const char *key, float *out, int *found);
kiln_status kiln_gguf_get_bool(const kiln_gguf *g, const char *key, int *out, int *found);
kiln_status kiln_gguf_get_str(const kiln_gguf *g, const char *key, kiln_gguf_str *out,
                              int *found);
/* Array element access (bounds and type checked by the caller via kv->arr_type/arr_len). */
int32_t kiln_gguf_arr_i32(const kiln_gguf_kv *kv, uint64_t i);
float kiln_gguf_arr_f32(const kiln_gguf_kv *kv, uint64_t i);
/* Element i of a string array; {NULL, 0} when kv is not a string array or i is out of range.
 * The string points into the file (not NUL-terminated). */
kiln_gguf_str kiln_gguf_arr_str(const kiln_gguf_kv *kv, uint64_t i);

/* Tensors. shape is outermost first (GGUF's ne[] reversed). data points into the file. */
int64_t kiln_gguf_n_tensors(const kiln_gguf *g);
const kiln_tensor *kiln_gguf_tensor_at(const kiln_gguf *g, int64_t i);
const kiln_tensor *kiln_gguf_find_tensor(const kiln_gguf *g, const char *name);

/* Map a GGML type id to kiln's dtype; false for types kiln does not support. */
bool kiln_gguf_dtype_from_ggml(uint32_t ggml_type, kiln_dtype *out);

#endif /* KILN_GGUF_H */
