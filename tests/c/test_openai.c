/* test_openai.c -- OpenAI request parsing and answer JSON (src/serve/openai.h): a table of
 * good bodies with the fields they must give, a table of bad ones with the param and words
 * the 400 must name, and the shapes of the answers (parsed back with cJSON). */
#include "base/base.h"
#include "serve/openai.h"
#include "test_util.h"

#include <cjson/cJSON.h>
#include <math.h>

typedef struct bad_case {
    kiln_oai_kind kind;
    const char *body;
    const char *param;  /* err.param */
    const char *needle; /* in err.message */
} bad_case;

static const bad_case BAD[] = {
    {KILN_OAI_CHAT, "", "", "empty"},
    {KILN_OAI_CHAT, "{", "", "not valid JSON"},
    {KILN_OAI_CHAT, "[1]", "", "JSON object"},
    {KILN_OAI_CHAT, "{} {}", "", "more than one JSON value"},
    {KILN_OAI_CHAT, "{\"model\":\"m\"}", "messages", "'messages' is required"},
    {KILN_OAI_CHAT, "{\"messages\":[]}", "messages", "at least one"},
    {KILN_OAI_CHAT, "{\"messages\":\"hi\"}", "messages", "'messages' is required"},
    {KILN_OAI_CHAT, "{\"messages\":[1]}", "messages[0]", "must be an object"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", "messages[0]", "role"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "messages[0]", "wizard"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0]", "content"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", "messages[0]", "content"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", "messages[0]",
     "only text parts"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":3}]}]}", "messages[0]",
     "content[0].text"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", "", "escaped NUL"},
    {KILN_OAI_CHAT, "{\"model\":3,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", "model", "'model'"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":\"hot\"}", "temperature",
     "'temperature' must be a number"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":2.5}", "temperature", "[0, 2]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":-1}", "temperature", "got -1"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_p\":0}", "top_p", "(0, 1]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_p\":1.5}", "top_p", "top_p"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_k\":-2}", "top_k", "top_k"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_k\":1.5}", "top_k", "integer"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"min_p\":2}", "min_p", "min_p"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":-1}", "max_tokens", "max_tokens"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":\"5\"}", "max_tokens", "integer"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":1e12}",
     "max_completion_tokens", "max_completion_tokens"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":0}", "n", "'n'"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":17}", "n", "[1, 16]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"seed\":1.5}", "seed", "integer"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"seed\":1e300}", "seed", "seed"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":5}", "stop", "'stop'"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}",
     "stop", "at most 4"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[\"a\",1]}", "stop", "stop[1]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":\"\"}", "stop", "empty"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":\"yes\"}", "stream", "boolean"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream_options\":1}", "stream_options",
     "object"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream_options\":{\"include_usage\":1}}",
     "stream_options", "include_usage"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":3}", "logprobs", "boolean"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":3}", "top_logprobs",
     "needs 'logprobs'"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}",
     "top_logprobs", "[0, 20]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"presence_penalty\":3}", "presence_penalty",
     "[-2, 2]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"frequency_penalty\":-2.5}",
     "frequency_penalty", "frequency_penalty"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"repetition_penalty\":0}",
     "repetition_penalty", "(0, 100]"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"ignore_eos\":1}", "ignore_eos", "boolean"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", "tools", "not supported"},
    {KILN_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_object\"}}",
     "response_format", "not supported"},
    {KILN_OAI_COMPLETION, "{\"model\":\"m\"}", "prompt", "'prompt' is required"},
    {KILN_OAI_COMPLETION, "{\"prompt\":5}", "prompt", "string or an array"},
    {KILN_OAI_COMPLETION, "{\"prompt\":[]}", "prompt", "must not be empty"},
    {KILN_OAI_COMPLETION, "{\"prompt\":[1,-2]}", "prompt", "prompt[1]"},
    {KILN_OAI_COMPLETION, "{\"prompt\":[1,2.5]}", "prompt", "token id"},
    {KILN_OAI_COMPLETION, "{\"prompt\":[\"a\",\"b\"]}", "prompt", "not a batch"},
    {KILN_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":true}", "logprobs", "integer"},
    {KILN_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":21}", "logprobs", "[0, 20]"},
    {KILN_OAI_COMPLETION, "{\"prompt\":\"x\",\"echo\":true}", "echo", "not supported"},
    {KILN_OAI_COMPLETION, "{\"prompt\":\"x\",\"best_of\":3}", "best_of", "not supported"},
    {KILN_OAI_COMPLETION, "{\"prompt\":\"x\",\"suffix\":\"y\"}", "suffix", "not supported"},
};

static void test_bad_bodies(void) {
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        const bad_case *c = &BAD[i];
        kiln_oai_request r;
        kiln_oai_error e;
        kiln_status st = kiln_oai_parse_request(c->body, strlen(c->body), c->kind, &r, &e);
        CHECK_MSG(st == KILN_ERR_INVALID_ARG, "case %zu (%s): status %d", i, c->body, (int)st);
        CHECK_MSG(e.http_status == 400, "case %zu: http %d", i, e.http_status);
        CHECK_MSG(e.type && !strcmp(e.type, "invalid_request_error"), "case %zu: type", i);
        CHECK_MSG(!strcmp(e.param, c->param), "case %zu (%s): param '%s', want '%s'", i, c->body, e.param, c->param);
        CHECK_MSG(strstr(e.message, c->needle) != NULL, "case %zu (%s): message '%s' lacks '%s'", i, c->body, e.message,
                  c->needle);
        CHECK_MSG(r.messages == NULL && r.prompt == NULL && r.model == NULL, "case %zu: out not zeroed", i);
        kiln_oai_request_free(&r); /* a no-op on a zeroed struct */
    }
}

static void test_defaults(void) {
    const char *b = "{\"model\":\"kiln\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"unknown\":{\"x\":[1]}}";
    kiln_oai_request r;
    kiln_oai_error e;
    CHECK(kiln_oai_parse_request(b, strlen(b), KILN_OAI_CHAT, &r, &e) == KILN_OK);
    CHECK(r.kind == KILN_OAI_CHAT && r.model && !strcmp(r.model, "kiln"));
    CHECK(r.n_messages == 1 && !strcmp(r.messages[0].role, "user") && !strcmp(r.messages[0].content, "hi"));
    CHECK(r.max_tokens == -1 && r.temperature == 1.0f && r.top_p == 1.0f && r.top_k == 0 && r.min_p == 0.0f);
    CHECK(!r.has_seed && r.n_stop == 0 && r.stop[0] == NULL && r.n == 1 && !r.stream && !r.include_usage);
    CHECK(r.logprobs == -1 && r.presence_penalty == 0 && r.frequency_penalty == 0 && r.repetition_penalty == 1.0f);
    CHECK(!r.ignore_eos && r.prompt == NULL);
    kiln_oai_request_free(&r);
}

static void test_all_fields_chat(void) {
    const char *b =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
        "{\"role\":\"assistant\",\"content\":null},{\"role\":\"user\",\"content\":\"q\",\"name\":\"bob\"}],"
        "\"max_tokens\":5,\"max_completion_tokens\":7,\"temperature\":0,\"top_p\":0.5,\"top_k\":-1,\"min_p\":0.1,"
        "\"seed\":-3,\"stop\":[\"x\",\"yy\"],\"n\":3,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"logprobs\":true,\"top_logprobs\":2,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
        "\"repetition_penalty\":1.1,\"ignore_eos\":true,\"tools\":[],\"response_format\":{\"type\":\"text\"}}";
    kiln_oai_request r;
    kiln_oai_error e;
    kiln_status st = kiln_oai_parse_request(b, strlen(b), KILN_OAI_CHAT, &r, &e);
    CHECK_MSG(st == KILN_OK, "%s", e.message);
    if (st != KILN_OK) return;
    CHECK(r.n_messages == 4);
    CHECK(!strcmp(r.messages[0].role, "system") && !strcmp(r.messages[0].content, "be brief"));
    CHECK(!strcmp(r.messages[1].content, "a\nb"));
    CHECK(!strcmp(r.messages[2].role, "assistant") && !strcmp(r.messages[2].content, ""));
    CHECK(r.max_tokens == 7 && r.temperature == 0.0f && r.top_p == 0.5f && r.top_k == -1);
    CHECK(fabsf(r.min_p - 0.1f) < 1e-7f && r.has_seed && r.seed == -3);
    CHECK(r.n_stop == 2 && !strcmp(r.stop[0], "x") && !strcmp(r.stop[1], "yy") && r.stop[2] == NULL);
    CHECK(r.n == 3 && r.stream && r.include_usage && r.logprobs == 2);
    CHECK(r.presence_penalty == 0.5f && r.frequency_penalty == -0.5f && fabsf(r.repetition_penalty - 1.1f) < 1e-6f);
    CHECK(r.ignore_eos);
    kiln_oai_request_free(&r);
}

static void test_completion_prompts(void) {
    struct {
        const char *body;
        const char *text; /* NULL: ids */
        size_t n_ids;
        int logprobs;
    } good[] = {
        {"{\"prompt\":\"Hello\"}", "Hello", 0, -1},
        {"{\"prompt\":[\"Hello\"],\"logprobs\":null}", "Hello", 0, -1},
        {"{\"prompt\":\"\",\"logprobs\":0}", "", 0, 0},
        {"{\"prompt\":[1,2,3],\"logprobs\":5}", NULL, 3, 5},
        {"{\"prompt\":[[7,8]],\"stop\":\"\\n\"}", NULL, 2, -1},
        {"  {\"prompt\":\"x\",\"echo\":false,\"best_of\":1,\"suffix\":\"\"}\n", "x", 0, -1},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        kiln_oai_request r;
        kiln_oai_error e;
        kiln_status st = kiln_oai_parse_request(good[i].body, strlen(good[i].body), KILN_OAI_COMPLETION, &r, &e);
        CHECK_MSG(st == KILN_OK, "good %zu: %s", i, e.message);
        if (st != KILN_OK) continue;
        if (good[i].text) CHECK_MSG(r.prompt && !strcmp(r.prompt, good[i].text) && r.prompt_len == strlen(good[i].text),
                                    "good %zu", i);
        else CHECK_MSG(!r.prompt && r.n_prompt_ids == good[i].n_ids && r.prompt_ids[0] >= 1, "good %zu", i);
        CHECK_MSG(r.logprobs == good[i].logprobs, "good %zu: logprobs %d", i, r.logprobs);
        kiln_oai_request_free(&r);
    }
    /* a body that is not NUL-terminated: only len bytes are read */
    const char body[] = "{\"prompt\":\"ab\"}XXXX";
    kiln_oai_request r;
    kiln_oai_error e;
    CHECK(kiln_oai_parse_request(body, 15, KILN_OAI_COMPLETION, &r, &e) == KILN_OK);
    CHECK(r.prompt && !strcmp(r.prompt, "ab"));
    kiln_oai_request_free(&r);
}

static cJSON *parse_back(char *s) {
    CHECK(s != NULL);
    cJSON *j = s ? cJSON_Parse(s) : NULL;
    CHECK(j != NULL);
    kiln_oai_free(s);
    return j;
}

static void test_answers(void) {
    kiln_oai_token toks[2] = {{.id = 1, .logprob = -0.5f, .n_top = 2, .top_ids = {1, 2}, .top_logprobs = {-0.5f, -1.5f}},
                              {.id = 2, .logprob = -INFINITY, .n_top = 0}};
    kiln_oai_meta m = {KILN_OAI_CHAT, "chatcmpl-1", "kiln-model", 1700000000, 2, NULL};
    /* invalid UTF-8 in, valid JSON out */
    kiln_oai_choice c = {.index = 0, .text = "hi \xff there", .len = 10, .finish_reason = "stop", .tokens = toks,
                         .n_tokens = 2};
    kiln_oai_usage u = {5, 2, 1};
    cJSON *j = parse_back(kiln_oai_response_json(&m, &c, 1, &u));
    if (j) {
        CHECK(!strcmp(cJSON_GetObjectItem(j, "object")->valuestring, "chat.completion"));
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        cJSON *msg = cJSON_GetObjectItem(ch, "message");
        CHECK(!strcmp(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant"));
        CHECK(!strcmp(cJSON_GetObjectItem(msg, "content")->valuestring, "hi \xEF\xBF\xBD there"));
        CHECK(!strcmp(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "stop"));
        cJSON *content = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content");
        CHECK(cJSON_GetArraySize(content) == 2);
        cJSON *t0 = cJSON_GetArrayItem(content, 0);
        CHECK(cJSON_GetObjectItem(t0, "logprob")->valuedouble == -0.5);
        CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(t0, "top_logprobs")) == 2);
        CHECK(cJSON_IsArray(cJSON_GetObjectItem(t0, "bytes")));
        CHECK(cJSON_GetObjectItem(cJSON_GetArrayItem(content, 1), "logprob")->valuedouble == -9999.0);
        cJSON *us = cJSON_GetObjectItem(j, "usage");
        CHECK(cJSON_GetObjectItem(us, "total_tokens")->valuedouble == 7);
        CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(us, "prompt_tokens_details"), "cached_tokens")->valuedouble == 1);
        cJSON_Delete(j);
    }
    /* chat chunks: the first carries the role; a usage chunk has no choices */
    c.first = 1;
    c.finish_reason = NULL;
    c.tokens = NULL;
    j = parse_back(kiln_oai_chunk_json(&m, &c, 1, NULL, 1));
    if (j) {
        CHECK(!strcmp(cJSON_GetObjectItem(j, "object")->valuestring, "chat.completion.chunk"));
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        CHECK(!strcmp(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "role")->valuestring, "assistant"));
        CHECK(cJSON_IsNull(cJSON_GetObjectItem(ch, "finish_reason")));
        CHECK(cJSON_IsNull(cJSON_GetObjectItem(ch, "logprobs")));
        CHECK(cJSON_IsNull(cJSON_GetObjectItem(j, "usage")));
        cJSON_Delete(j);
    }
    j = parse_back(kiln_oai_chunk_json(&m, NULL, 0, &u, 1));
    if (j) {
        CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")) == 0);
        CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valuedouble == 2);
        cJSON_Delete(j);
    }
    /* completions: text, and logprobs in the legacy shape */
    m.kind = KILN_OAI_COMPLETION;
    m.id = "cmpl-1";
    kiln_oai_choice cc = {.index = 3, .text = "abc", .len = 3, .finish_reason = "length", .tokens = toks, .n_tokens = 2};
    j = parse_back(kiln_oai_response_json(&m, &cc, 1, &u));
    if (j) {
        CHECK(!strcmp(cJSON_GetObjectItem(j, "object")->valuestring, "text_completion"));
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        CHECK(cJSON_GetObjectItem(ch, "index")->valuedouble == 3);
        CHECK(!strcmp(cJSON_GetObjectItem(ch, "text")->valuestring, "abc"));
        cJSON *lp = cJSON_GetObjectItem(ch, "logprobs");
        CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")) == 2);
        CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "token_logprobs")) == 2);
        CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "text_offset")) == 2);
        CHECK(cJSON_IsObject(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0)));
        cJSON_Delete(j);
    }
    j = parse_back(kiln_oai_error_json("'n' must be ...", "invalid_request_error", "n", NULL));
    if (j) {
        cJSON *e = cJSON_GetObjectItem(j, "error");
        CHECK(!strcmp(cJSON_GetObjectItem(e, "param")->valuestring, "n"));
        CHECK(cJSON_IsNull(cJSON_GetObjectItem(e, "code")));
        cJSON_Delete(j);
    }
    j = parse_back(kiln_oai_models_json("kiln-model", 1, 2048));
    if (j) {
        cJSON *d = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "data"), 0);
        CHECK(!strcmp(cJSON_GetObjectItem(d, "id")->valuestring, "kiln-model"));
        cJSON_Delete(j);
    }
}

static void test_utf8_clean(void) {
    struct {
        const char *in;
        size_t len;
        const char *out;
    } cases[] = {
        {"abc", 3, "abc"},
        {"\xc3\xa9", 2, "\xc3\xa9"},
        {"\xc3", 1, "\xEF\xBF\xBD"},
        {"\xc0\xaf", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},          /* overlong */
        {"\xed\xa0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* a surrogate */
        {"a\0b", 3, "a\xEF\xBF\xBD" "b"},
        {"\xf0\x9f\x98\x80", 4, "\xf0\x9f\x98\x80"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n;
        char *o = kiln_oai_utf8_clean(cases[i].in, cases[i].len, &n);
        CHECK_MSG(o && n == strlen(cases[i].out) && !memcmp(o, cases[i].out, n), "utf8 case %zu", i);
        kiln_free(o);
    }
}

int main(void) {
    kiln_mem_stats before, after;
    kiln_mem_get_stats(&before);
    test_bad_bodies();
    test_defaults();
    test_all_fields_chat();
    test_completion_prompts();
    test_answers();
    test_utf8_clean();
    kiln_mem_get_stats(&after);
    CHECK_MSG(after.live_blocks == before.live_blocks, "leaked %zu blocks", after.live_blocks - before.live_blocks);
    printf("test_openai: %d checks, %d failures\n", t_checks, t_failures);
    return t_failures ? 1 : 0;
}
