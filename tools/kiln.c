/* kiln.c -- the kiln command-line tool: dispatch to subcommands. */
#include "cli.h"

#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "kiln %s -- a C engine for transformer language models\n\n"
            "usage: kiln <command> [options]\n\n"
            "commands:\n"
            "  generate    generate text from a prompt\n"
            "  chat        interactive chat with the model's chat template\n"
            "  tokenize    text to token ids and pieces\n"
            "  detokenize  token ids to text\n"
            "  info        architecture, parameters, tensors, tokenizer, template\n"
            "  data        text files to a token shard for training\n"
            "  train       train or fine-tune a model on the CPU or a CUDA GPU\n\n"
            "MODEL is a .gguf file or a Hugging Face folder. 'kiln <command> --help' for options.\n",
            kiln_version());
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("kiln %s\n", kiln_version());
        return 0;
    }
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "chat")) return cmd_chat(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "detokenize")) return cmd_detokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "data")) return cmd_data(argc - 1, argv + 1);
    if (!strcmp(cmd, "train")) return cmd_train(argc - 1, argv + 1);
    fprintf(stderr, "kiln: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
