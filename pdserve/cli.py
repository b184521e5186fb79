"""`pdserve serve | instance | router | bench ...`: one entry point; each subcommand's module is imported only
when it runs, so `pdserve router` never imports torch and `pdserve --help` is instant."""

from __future__ import annotations

import argparse
import sys


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model: one colocated instance, or --prefill X --decode Y behind a router")
    from pdserve.server.main import add_arguments

    add_arguments(p)
    p.add_argument("--prefill", type=int, default=0, metavar="X",
                   help="start X prefill instances, Y decode instances and a router on this machine")
    p.add_argument("--decode", type=int, default=0, metavar="Y", help="number of decode instances (with --prefill)")
    p.add_argument("--router-port", type=int, default=None,
                   help="with --prefill/--decode: the router's port (default --port); instances take the next ones")
    from pdserve.router.launcher import add_arguments as add_launcher_arguments

    add_launcher_arguments(p)  # --both, --startup-timeout, --log-dir, --policy and the router's tunables
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> int:
    if args.prefill or args.decode or getattr(args, "both", 0):
        from pdserve.router.launcher import run as run_launcher

        return run_launcher(args)
    from pdserve.server.main import run

    return run(args)


def _instance_parser(sub) -> None:
    p = sub.add_parser("instance", help="one engine instance with a role (prefill, decode or both)")
    from pdserve.server.main import add_arguments, run

    add_arguments(p)
    p.set_defaults(func=run)


def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible router over prefill/decode instance pools")
    from pdserve.router.main import add_arguments, run

    add_arguments(p)
    p.set_defaults(func=run)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: serve, search, sweep, compare, plot, transfer")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from pdserve.bench.cli import add_subcommands

    add_subcommands(bsub)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n")[0])
    from pdserve import __version__

    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # build only the subcommand asked for, so its imports are the only ones paid
    wanted = next((a for a in argv if not a.startswith("-")), None)
    builders = {"serve": _serve_parser, "instance": _instance_parser, "router": _router_parser, "bench": _bench_parser}
    for name, build in builders.items():
        if wanted in (None, name) or wanted not in builders:
            if wanted is None or wanted not in builders:
                sub.add_parser(name, help=f"see `pdserve {name} --help`")
            else:
                build(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
