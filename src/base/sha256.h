/*
 * sha256.h -- SHA-256 (FIPS 180-4) through OpenSSL's libcrypto: the checksums of kiln's
 * checkpoints and token shards, and the fingerprints and receipt chains of
 * docs/REPRODUCIBILITY.md.
 */
#ifndef KILN_SHA256_H
#define KILN_SHA256_H

#include "base.h"

/* out = SHA-256(data[0..n)). Returns KILN_ERR_INTERNAL if libcrypto fails. */
kiln_status kiln_sha256(const void *data, size_t n, uint8_t out[32]);
/* Lowercase hex of a 32-byte digest into hex[65] (NUL-terminated). */
void kiln_sha256_hex(const uint8_t digest[32], char hex[65]);
/* The 32 bytes of a 64-character hex digest (either case); false for anything else. */
bool kiln_sha256_from_hex(const char *hex, uint8_t out[32]);

/* Streaming SHA-256: init, update*, final (final also frees; free alone abandons). */
typedef struct kiln_sha256_ctx kiln_sha256_ctx;
kiln_status kiln_sha256_init(kiln_sha256_ctx **out);
kiln_status kiln_sha256_update(kiln_sha256_ctx *c, const void *data, size_t n);
kiln_status kiln_sha256_final(kiln_sha256_ctx *c, uint8_t out[32]);
void kiln_sha256_free(kiln_sha256_ctx *c);

#endif /* KILN_SHA256_H */
