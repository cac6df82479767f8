/* An LD_PRELOAD library for the llama.cpp tools that log through common/log.cpp (llama-completion,
 * llama-bench, llama-perplexity, llama-server): it drains their asynchronous logger at exit.
 *
 * Why: common_log_main() is leaked on purpose and never joined (common/log.cpp, llama.cpp issue
 * 22142), so a tool that returns from main() while its logger thread is behind loses the tail of
 * its output: the generated text, the timings. On a loaded 2-core machine that happened in 16 of
 * 20 runs of a tiny model (the whole run takes ~20 ms). This destructor runs after main() returns
 * and before libllama-common is unloaded; common_log_pause() queues an end marker and joins the
 * logger thread, which first writes out every message queued before it. Nothing else changes:
 * the tool's numerics and arguments are untouched. */
#include "log.h"

__attribute__((destructor)) static void drain_common_log(void) {
    common_log_pause(common_log_main());
}
