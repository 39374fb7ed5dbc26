/*
 * fuzz_tokenizer_json.c -- libFuzzer target for the tokenizer.json / tokenizer_config.json
 * loader. The input is split at the first NUL byte: tokenizer.json before it, the optional
 * tokenizer_config.json after it. A tokenizer that loads is exercised on a fixed text.
 */
#include "tokenizer/tokenizer.h"

#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *tok_json = (const char *)data;
    size_t tok_len = size, cfg_len = 0;
    const char *cfg_json = NULL;
    const uint8_t *nul = memchr(data, 0, size);
    if (nul) {
        tok_len = (size_t)(nul - data);
        cfg_json = (const char *)nul + 1;
        cfg_len = size - tok_len - 1;
    }
    kiln_tokenizer *t = NULL;
    if (kiln_tokenizer_from_hf_json(tok_json, tok_len, cfg_json, cfg_len, "fuzz", &t) == KILN_OK) {
        static const char text[] = "Hello wörld 123 <|im_start|> 🙂\n\t x";
        int32_t ids[256];
        size_t n = 0;
        if (kiln_tokenize(t, text, sizeof text - 1, 1, 1, ids, 256, &n) == KILN_OK) {
            char buf[1024];
            size_t m = 0;
            kiln_detokenize(t, ids, n, 1, buf, sizeof buf, &m);
        }
        kiln_chat_message msg = {"user", "hi"};
        char buf[512];
        size_t m = 0;
        kiln_chat_apply(t, &msg, 1, 1, buf, sizeof buf, &m);
        kiln_tokenizer_free(t);
    }
    return 0;
}
