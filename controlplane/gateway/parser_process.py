"""The start of a request body parser process (body_parsing's pool). A parser imports this module,
body_check and the contract only: none of them may import Django's models, which a spawned process
without Django set up cannot load (gateway.errors, for one, reaches billing's models)."""

import os
import threading
import time

# How much less of the CPU a parser process gets than the processes it shares a host with (nice(1)).
PARSER_NICENESS = 10


def start_parser() -> None:
    """A parser process yields the CPU to the event loops and replicas streaming tokens whenever
    they compete for it: a parse waiting a few milliseconds delays one request, a loop that waits
    delays every stream it relays. It exits with the gateway process: one killed outright (SIGKILL)
    tells its pool nothing, and the pool's queue would keep the parser waiting for ever."""
    os.nice(PARSER_NICENESS)
    gateway = os.getppid()

    def exit_with_the_gateway() -> None:
        while os.getppid() == gateway:  # once the gateway is gone the parser has another parent
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_with_the_gateway, name="exit-with-the-gateway", daemon=True).start()
