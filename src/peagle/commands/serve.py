"""``peagle serve``: its flags, the ``engine`` and ``capture`` sections (:class:`ServeConfig`) and the checks
made before anything starts; the server is :func:`peagle.traffic.serve.server_command` run under
:func:`peagle.traffic.serve.supervise`, and that module's docstring is this command's ``--help``.

Exit status: 2 bad input; else the server's (128 + the signal when a signal stopped it).
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from pydantic import Field

from .. import config as C
from ..engine.settings import EngineSettings
from ..errors import PeagleError, report
from ..speed import SpeculationSchedule
from ..storage import check_uri, parse_uri
from ..traffic import serve
from ..traffic.swap import TOKEN_ENV as SWAP_TOKEN_ENV
from ..traffic.serve import DEFAULT_PORT, server_command, supervise
from ..traffic.settings import CaptureSettings


class ServeConfig(C.StrictModel):
    """``--config`` / ``--set`` sections of ``peagle serve``."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle serve", description=serve.__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(serve.__doc__.splitlines()[2:]))
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--draft", required=True, help="P-EAGLE draft directory (vLLM format)")
    p.add_argument("--capture", metavar="URI", help="capture served requests into this traffic log (local "
                   "directory or s3:// URI); off without it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name", help="model name of the API (default: the target path)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, help="K (default: the draft's trained depths)")
    p.add_argument("--schedule", metavar="PATH", help="the speculation schedule the evaluation chose (its "
                   "schedule.json or the evaluate output): K per batch size; the target alone where it drafts nowhere")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--swap", action="store_true", help="answer the draft swap endpoint /peagle/v1/draft behind the "
                   "bearer token in the environment variable PEAGLE_SWAP_TOKEN (docs/traffic.md)")
    p.add_argument("--config", help="YAML with 'engine' and 'capture' sections")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set capture.sample_rate=0.5 (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true")
    # capture flags are --capture-<field>: the bare names (--uri, --enabled) would not say what they set
    C.add_flags(p, CaptureSettings, "capture", group=p.add_argument_group("capture settings (PEAGLE_CAPTURE_*)"),
                prefix="capture.")
    C.add_flags(p, EngineSettings, "engine")
    return p


def load_config(ns: argparse.Namespace) -> ServeConfig:
    """YAML < ``--set`` < flags; ``--capture URI`` turns the capture on with that root."""
    values = {}
    for key, value in C.flag_values(ns).items():
        section, name = key.split(".", 1)
        values[f"{section}.{name.removeprefix('capture.')}"] = value
    if ns.capture:
        values.update({"capture.enabled": True, "capture.uri": ns.capture})
    return C.build_config(ServeConfig, ns.config, ns.overrides, values, own_sections_only=True)


def check_settings(ns: argparse.Namespace, cfg: ServeConfig) -> None:
    """What the server would only find after loading the model, checked before anything starts
    (``--flag: why``, exit 2): the port, that the server could listen on the host and port now (vLLM would
    find it only after its imports, as a traceback), and the capture's traffic log URI (a local one not a
    file). The redaction patterns are compiled where the capture settings are built."""
    if not 1 <= ns.port <= 65535:
        raise C.ConfigError(f"--port: not a TCP port 1..65535 (got {ns.port})")
    try:  # as vLLM binds its socket (SO_REUSEADDR: a port left in TIME_WAIT is free)
        with socket.socket(socket.AF_INET6 if ":" in ns.host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ns.host, ns.port))
    except OSError as exc:
        flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise C.ConfigError(f"{flag}: cannot listen on {ns.host}:{ns.port} ({exc.strerror or exc})") from None
    if cfg.capture.enabled:
        check_uri(cfg.capture.uri, "--capture")
        parsed = parse_uri(cfg.capture.uri)
        if parsed.scheme in ("local", "file") and os.path.exists(parsed.path) and not os.path.isdir(parsed.path):
            raise C.ConfigError(f"--capture: {parsed.path} is a file, not a traffic log directory")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        cfg = load_config(ns)
        check_settings(ns, cfg)
        schedule = SpeculationSchedule.read(ns.schedule) if ns.schedule else None
        swap_token = os.environ.get(SWAP_TOKEN_ENV, "").strip() if ns.swap else None
        if ns.swap and not swap_token:
            raise C.ConfigError(f"--swap: the swap endpoint's token comes from the environment variable "
                                f"{SWAP_TOKEN_ENV}, which is empty")
        cmd, env = server_command(ns.target, ns.draft, k=ns.num_speculative_tokens, host=ns.host, port=ns.port,
                                  served_model_name=ns.served_model_name, engine=cfg.engine,
                                  capture=cfg.capture, dtype=ns.dtype, schedule=schedule, swap_token=swap_token)
    except PeagleError as exc:
        return report(exc)
    where = f", capturing into {cfg.capture.uri}" if cfg.capture.enabled else ""
    print(f"peagle serve: http://{ns.host}:{ns.port}/v1{where}", file=sys.stderr, flush=True)
    return supervise(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
