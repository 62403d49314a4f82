/*
 * status.c - names of the core's status codes.
 */
#include "mha.h"

const char *mha_status_name(mha_status s)
{
    switch (s) {
    case MHA_OK:
        return "MHA_OK";
    case MHA_ERR_NOMEM:
        return "MHA_ERR_NOMEM";
    case MHA_ERR_SIZE:
        return "MHA_ERR_SIZE";
    case MHA_ERR_ARG:
        return "MHA_ERR_ARG";
    case MHA_ERR_INTERRUPTED:
        return "MHA_ERR_INTERRUPTED";
    }
    /* A value outside the enum: still a static string, never NULL. */
    return "MHA_ERR_UNKNOWN";
}
