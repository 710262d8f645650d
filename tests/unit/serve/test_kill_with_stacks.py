"""A replica killed for overrunning its stop deadline leaves its threads' stacks in the
log first, so a hang at shutdown names the function it hung in."""

from __future__ import annotations

import asyncio
import sys
import textwrap

from splitserve.serve.supervisor import kill_with_stacks

CHILD = textwrap.dedent("""
    import faulthandler, sys, time
    from splitserve.contracts.kit.procs import STACK_DUMP_SIGNAL
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)

    def stuck_in_shutdown():
        print("ready", flush=True)
        while True:
            time.sleep(0.05)

    stuck_in_shutdown()
""")


async def _run() -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ready"
    await kill_with_stacks([proc])
    out = await asyncio.wait_for(proc.stdout.read(), 30)
    return await asyncio.wait_for(proc.wait(), 30), out.decode()


def test_an_overrunning_process_dumps_its_stacks_then_is_killed():
    code, out = asyncio.run(_run())
    assert code == -9, out  # SIGKILL: the dump did not end it
    assert "stuck_in_shutdown" in out, out


def test_nothing_to_do_for_processes_already_gone():
    async def gone():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await proc.wait()
        await kill_with_stacks([proc])  # neither raises nor waits
        return proc.returncode

    assert asyncio.run(gone()) == 0
