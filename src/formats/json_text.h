/*
 * json_text.h -- checks on JSON text before cJSON sees it.
 *
 * cJSON decodes "\u0000" inside a string into a NUL byte and hands the string out as a C
 * string, so "llama\u0000junk" reads as "llama": a name that is not the one in the file. The
 * readers of kiln's JSON inputs (config.json, generation_config.json, safetensors headers and
 * indexes, tokenizer files) refuse such text first, with the line and column of the string.
 */
#ifndef KILN_FORMATS_JSON_TEXT_H
#define KILN_FORMATS_JSON_TEXT_H

#include "../base/base.h"

#include <stddef.h>

/* KILN_OK unless text[0..len) holds a NUL byte, or a string holding the escape \u0000; then KILN_ERR_FORMAT "<label>: line L, column C: a JSON string
 * holds an escaped NUL (\u0000) after \"<the string's start>\"". Escaped backslashes
 * ("\\u0000" is six characters, not a NUL) are told apart. Does not validate the JSON. */
kiln_status kiln_json_check_no_nul(const char *text, size_t len, const char *label);

#endif /* KILN_FORMATS_JSON_TEXT_H */
