"""``specdecode models list|pull|verify``: what the catalog knows, whether it is converted, and
whether its files are intact."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="named models: source, size, installed and converted or not, and which "
                                     "weight forms are cached (native: the GGUF repacked; int4: packed as a "
                                     "draft; float32: dequantized)")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(run=run_list)
    pull = sub.add_parser("pull", help="convert a named model now (it is otherwise converted on first use)")
    pull.add_argument("name", help="a catalog name, e.g. qwen2.5-coder-0.5b-instruct")
    pull.set_defaults(run=run_pull)
    verify = sub.add_parser("verify", help="hash every file a named model runs from (its GGUF parts against pip's "
                                           "RECORD, its converted and cached forms against the checksums recorded "
                                           "when they were written); damaged caches are deleted so the next use "
                                           "rebuilds them. Exit 1 when anything is damaged or missing")
    verify.add_argument("name", help="a catalog name, e.g. qwen2.5-coder-1.5b-instruct")
    verify.add_argument("--json", action="store_true", help="print a JSON list of findings instead of a table")
    verify.set_defaults(run=run_verify)


def run_list(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import list_models

    rows = list_models()
    if args.json:
        print(json.dumps([{"name": m.name, "source": m.source, "size_bytes": m.size_bytes,
                           "installed": m.installed, "converted": m.converted, "path": str(m.path),
                           "forms": list(m.forms)}
                          for m in rows]))
        return 0
    print(f"{'NAME':32} {'SIZE':>8}  {'INSTALLED':9}  {'CONVERTED':9}  {'CACHED':14}  SOURCE")
    for m in rows:
        print(f"{m.name:32} {m.size_bytes / 2**20:7.0f}M  {'yes' if m.installed else 'no':9}  "
              f"{'yes' if m.converted else 'no':9}  {','.join(m.forms) or '-':14}  {m.source}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from specdecode.models.catalog import pull

    print(pull(args.name, progress=True))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from specdecode.models.integrity import verify

    findings = verify(args.name, progress=not args.json)
    if args.json:
        print(json.dumps([f.to_json() for f in findings]))
    else:
        for f in findings:
            print(f"{f.state.value:10} {f.what:10} {f.path}" + (f"  ({f.action})" if f.action else ""))
    bad = [f for f in findings if f.problem]
    if not args.json:
        print(f"{args.name}: " + (f"{len(bad)} problem(s)" if bad else "intact"))
    return 1 if bad else 0
