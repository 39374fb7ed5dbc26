/* sha256.c -- SHA-256 over OpenSSL's EVP interface (sha256.h). */
#include "sha256.h"

#include <string.h>

#include <openssl/evp.h>

struct kiln_sha256_ctx {
    EVP_MD_CTX *md;
};

kiln_status kiln_sha256_init(kiln_sha256_ctx **out) {
    kiln_sha256_ctx *c = kiln_calloc(1, sizeof *c);
    if (!c) return kiln_error(KILN_ERR_NOMEM, "sha256: out of memory");
    c->md = EVP_MD_CTX_new();
    if (!c->md || EVP_DigestInit_ex(c->md, EVP_sha256(), NULL) != 1) {
        kiln_sha256_free(c);
        return kiln_error(KILN_ERR_INTERNAL, "sha256: libcrypto initialisation failed");
    }
    *out = c;
    return KILN_OK;
}

kiln_status kiln_sha256_update(kiln_sha256_ctx *c, const void *data, size_t n) {
    if (n && EVP_DigestUpdate(c->md, data, n) != 1)
        return kiln_error(KILN_ERR_INTERNAL, "sha256: libcrypto update failed");
    return KILN_OK;
}

kiln_status kiln_sha256_final(kiln_sha256_ctx *c, uint8_t out[32]) {
    unsigned int len = 0;
    int ok = EVP_DigestFinal_ex(c->md, out, &len) == 1 && len == 32;
    kiln_sha256_free(c);
    return ok ? KILN_OK : kiln_error(KILN_ERR_INTERNAL, "sha256: libcrypto final failed");
}

void kiln_sha256_free(kiln_sha256_ctx *c) {
    if (!c) return;
    EVP_MD_CTX_free(c->md);
    kiln_free(c);
}

kiln_status kiln_sha256(const void *data, size_t n, uint8_t out[32]) {
    unsigned int len = 0;
    if (EVP_Digest(n ? data : "", n, out, &len, EVP_sha256(), NULL) != 1 || len != 32)
        return kiln_error(KILN_ERR_INTERNAL, "sha256: libcrypto digest failed");
    return KILN_OK;
}

void kiln_sha256_hex(const uint8_t d[32], char hex[65]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[64] = 0;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

bool kiln_sha256_from_hex(const char *hex, uint8_t out[32]) {
    if (!hex) return false;
    uint8_t d[32];
    for (int i = 0; i < 32; i++) {
        int hi = hex_value(hex[2 * i]), lo = hi < 0 ? -1 : hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        d[i] = (uint8_t)(hi << 4 | lo);
    }
    if (hex[64] != '\0') return false;
    memcpy(out, d, 32);
    return true;
}
