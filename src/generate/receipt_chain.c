/*
 * receipt_chain.c -- the hash chain of a generation's logits (docs/REPRODUCIBILITY.md,
 * "Receipts"):
 *
 *   c_0     = SHA-256("kiln-receipt-v1\n" || model fingerprint || tokenizer fingerprint
 *                     || n_prompt as u64 || the prompt ids as i32)
 *   c_{i+1} = SHA-256(c_i || the n_vocab f32 logits from which generated token i was drawn)
 *
 * integers little-endian, floats as their IEEE-754 binary32 bytes, little-endian (kiln builds
 * only on little-endian hosts, so these are the bytes in memory). kiln_generate fills the
 * chain when kiln_generate_params.logits_chain asks for it; `kiln verify` recomputes it.
 */
#include "../base/sha256.h"
#include "generate.h"

#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "receipt chains hash little-endian bytes; this host is not"
#endif

#define RECEIPT_MAGIC "kiln-receipt-v1\n"

KILN_API kiln_status kiln_receipt_chain_start(const uint8_t model_fp[32],
                                              const uint8_t tokenizer_fp[32], const int32_t *prompt,
                                              size_t n_prompt, uint8_t out[32]) {
    if (!model_fp || !tokenizer_fp || !out || (n_prompt && !prompt))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_receipt_chain_start: NULL argument");
    kiln_sha256_ctx *c = NULL;
    KILN_TRY(kiln_sha256_init(&c));
    uint8_t n8[8];
    kiln_put_le64(n8, (uint64_t)n_prompt);
    kiln_status st = kiln_sha256_update(c, RECEIPT_MAGIC, strlen(RECEIPT_MAGIC));
    if (st == KILN_OK) st = kiln_sha256_update(c, model_fp, 32);
    if (st == KILN_OK) st = kiln_sha256_update(c, tokenizer_fp, 32);
    if (st == KILN_OK) st = kiln_sha256_update(c, n8, 8);
    if (st == KILN_OK) st = kiln_sha256_update(c, prompt, n_prompt * sizeof(int32_t));
    if (st != KILN_OK) {
        kiln_sha256_free(c);
        return st;
    }
    return kiln_sha256_final(c, out);
}

KILN_API kiln_status kiln_receipt_chain_step(const uint8_t prev[32], const float *logits,
                                             size_t n_vocab, uint8_t out[32]) {
    if (!prev || !logits || !out || !n_vocab)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_receipt_chain_step: NULL argument or empty row");
    kiln_sha256_ctx *c = NULL;
    KILN_TRY(kiln_sha256_init(&c));
    uint8_t p[32];
    memcpy(p, prev, 32); /* prev and out may be the same buffer */
    kiln_status st = kiln_sha256_update(c, p, 32);
    if (st == KILN_OK) st = kiln_sha256_update(c, logits, n_vocab * sizeof(float));
    if (st != KILN_OK) {
        kiln_sha256_free(c);
        return st;
    }
    return kiln_sha256_final(c, out);
}

kiln_status kiln_receipt_chain_begin(kiln_receipt_chain *rc, const kiln_model *m,
                                     const int32_t *prompt, size_t n_prompt, uint8_t *chain) {
    memset(rc, 0, sizeof *rc);
    uint8_t mfp[32], tfp[32];
    KILN_TRY(kiln_model_fingerprint(m, mfp));
    KILN_TRY(kiln_tokenizer_fingerprint(m->tok, tfp));
    KILN_TRY(kiln_receipt_chain_start(mfp, tfp, prompt, n_prompt, chain));
    rc->chain = chain;
    rc->hook.fn = kiln_receipt_chain_hook;
    rc->hook.user = rc;
    return KILN_OK;
}

kiln_status kiln_receipt_chain_hook(void *user, const float *logits, int n_vocab) {
    kiln_receipt_chain *rc = user;
    uint8_t *c = rc->chain + 32 * rc->steps;
    KILN_TRY(kiln_receipt_chain_step(c, logits, (size_t)n_vocab, c + 32));
    rc->steps++;
    return KILN_OK;
}
