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
            "  train       train or fine-tune a model on the CPU or a CUDA GPU\n"
            "  distill     train a student on a teacher's distributions (knowledge distillation)\n"
            "  export      a training checkpoint to a Hugging Face folder\n"
            "  serve       an OpenAI-compatible HTTP server (continuous batching)\n"
            "  fingerprint the model's fingerprint (SHA-256 of its weights as stored)\n"
            "  verify      re-run a generation receipt and compare it step by step\n"
            "  audit       check a training run's audit log, and replay its steps from a checkpoint\n\n"
            "MODEL is a .gguf file or a Hugging Face folder. 'kiln help <command>' or\n"
            "'kiln <command> --help' for its options.\n",
            kiln_version());
}

/* Run subcommand cmd with its own argv (argv[0] is cmd). */
static int run_command(const char *cmd, int argc, char **argv) {
    if (!strcmp(cmd, "generate")) return cmd_generate(argc, argv);
    if (!strcmp(cmd, "chat")) return cmd_chat(argc, argv);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc, argv);
    if (!strcmp(cmd, "detokenize")) return cmd_detokenize(argc, argv);
    if (!strcmp(cmd, "info")) return cmd_info(argc, argv);
    if (!strcmp(cmd, "data")) return cmd_data(argc, argv);
    if (!strcmp(cmd, "train")) return cmd_train(argc, argv);
    if (!strcmp(cmd, "distill")) return cmd_distill(argc, argv);
    if (!strcmp(cmd, "export")) return cmd_export(argc, argv);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc, argv);
    if (!strcmp(cmd, "fingerprint")) return cmd_fingerprint(argc, argv);
    if (!strcmp(cmd, "verify")) return cmd_verify(argc, argv);
    if (!strcmp(cmd, "audit")) return cmd_audit(argc, argv);
    fprintf(stderr, "kiln: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "help") && argc > 2) { /* kiln help CMD: CMD's own help */
        static char help_flag[] = "--help";
        char *args[] = {argv[2], help_flag, NULL};
        if (strcmp(argv[2], "help") != 0) return run_command(argv[2], 2, args);
    }
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("kiln %s\n", kiln_version());
        return 0;
    }
    return run_command(cmd, argc - 1, argv + 1);
}
