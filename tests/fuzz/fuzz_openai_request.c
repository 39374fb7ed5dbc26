/* fuzz_openai_request.c -- libFuzzer target: any bytes as the body of POST /v1/chat/completions
 * (first byte even) or /v1/completions (odd). A body that parses must hold what the parser
 * promises (openai.h): ranges, NULL-terminated stops, a prompt or messages; and the answer
 * built from it (its text echoed as the choice's text, any bytes) must be valid JSON. */
#include "base/base.h"
#include "serve/openai.h"

#include <cjson/cJSON.h>
#include <string.h>

static void check_json(char *s) {
    if (!s) return; /* out of memory */
    cJSON *j = cJSON_Parse(s);
    if (!j) __builtin_trap();
    cJSON_Delete(j);
    kiln_oai_free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    kiln_oai_kind kind = (data[0] & 1) ? KILN_OAI_COMPLETION : KILN_OAI_CHAT;
    kiln_oai_request r;
    kiln_oai_error e;
    kiln_status st = kiln_oai_parse_request((const char *)data + 1, size - 1, kind, &r, &e);
    if (st != KILN_OK) {
        if (st == KILN_ERR_INVALID_ARG && (e.http_status != 400 || !e.message[0])) __builtin_trap();
        check_json(kiln_oai_error_json(e.message, e.type, e.param, NULL));
        return 0;
    }
    if (r.n < 1 || r.n > KILN_OAI_MAX_N || r.n_stop > KILN_OAI_MAX_STOP || r.stop[r.n_stop]) __builtin_trap();
    if (r.logprobs < -1 || r.logprobs > KILN_MAX_TOP_LOGPROBS) __builtin_trap();
    if (!(r.temperature >= 0 && r.temperature <= 2 && r.top_p > 0 && r.top_p <= 1)) __builtin_trap();
    if (kind == KILN_OAI_CHAT && (r.n_messages < 1 || !r.messages[0].content)) __builtin_trap();
    if (kind == KILN_OAI_COMPLETION && !r.prompt == !r.prompt_ids) __builtin_trap();
    const char *text = kind == KILN_OAI_CHAT ? r.messages[r.n_messages - 1].content : r.prompt ? r.prompt : "";
    kiln_oai_token tok = {.id = 0, .logprob = -1.0f};
    kiln_oai_choice c = {.index = 0, .text = text, .len = strlen(text), .finish_reason = "stop",
                         .tokens = r.logprobs >= 0 ? &tok : NULL, .n_tokens = r.logprobs >= 0 ? 1 : 0, .first = 1};
    kiln_oai_meta m = {kind, "id", r.model, 0, r.logprobs, NULL};
    kiln_oai_usage u = {1, 1, 0};
    check_json(kiln_oai_response_json(&m, &c, 1, &u));
    check_json(kiln_oai_chunk_json(&m, &c, 1, r.include_usage ? &u : NULL, 1));
    kiln_oai_request_free(&r);
    return 0;
}
