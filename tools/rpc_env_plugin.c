/* A GGML_BACKEND_PATH plugin that makes any ggml tool (notably test-backend-ops, which has no
 * --rpc option) see one RPC device: the server named by $GGML_RPC_ENDPOINT (host:port).
 * ggml_backend_load() dlopens this file, calls ggml_backend_init() and registers the returned
 * reg; the RPC backend then appears as device "RPC0". */
#include <stdio.h>
#include <stdlib.h>

#include "ggml-backend.h"
#include "ggml-rpc.h"

GGML_BACKEND_API ggml_backend_reg_t ggml_backend_init(void) {
    const char * endpoint = getenv("GGML_RPC_ENDPOINT");
    if (endpoint == NULL || endpoint[0] == '\0') {
        fprintf(stderr, "rpc_env_plugin: set GGML_RPC_ENDPOINT=host:port\n");
        return NULL;
    }
    return ggml_backend_rpc_add_server(endpoint);
}
