/* fuzz_hf_config.c -- libFuzzer target: any bytes as config.json. A config that parses must
 * also pass validation (the parser validates before returning). */
#include "formats/hf_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kiln_model_config c;
    if (kiln_hf_config_parse((const char *)data, size, "fuzz", &c) != KILN_OK) return 0;
    if (kiln_model_config_validate(&c, "fuzz") != KILN_OK) __builtin_trap();
    return 0;
}
