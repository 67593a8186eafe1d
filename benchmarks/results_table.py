"""A Markdown table of the JSON lines that the benchmarks (throughput, latency, attention_sweep,
gemm_shapes) append with ``--json``.

    python benchmarks/results_table.py results.jsonl
"""

from __future__ import annotations

import json
import sys


def results_table(lines: list[str]) -> str:
    rows = ["| benchmark | settings | result |", "| --- | --- | --- |"]
    for line in lines:
        record = json.loads(line)
        if record["benchmark"] == "throughput":
            flags = ["--enforce-eager"] if record.get("enforce_eager") else []
            if record.get("custom_ops"):
                flags.append(f"--custom-ops={','.join(record['custom_ops'])}")
            if record.get("kv_cache_dtype"):
                flags.append(f"--kv-cache-dtype={record['kv_cache_dtype']}")
            for run in record["runs"]:
                rows.append(f"| throughput | {' '.join(flags) or 'defaults'} | {run['tok_per_s']:,} output tok/s "
                            f"({run['output_tokens']:,} tokens in {run['seconds']} s, {run['steps']:,} steps) |")
            for name in ("compare_micro_vllm", "compare_transformers"):
                if name in record:
                    part = record[name]
                    who = "micro-vLLM" if name == "compare_micro_vllm" else "transformers"
                    rows.append(f"| {who}, {part['requests']} requests | same process | "
                                f"{part['output_tokens'] / part['seconds']:,.0f} output tok/s "
                                f"({part['output_tokens']:,} tokens in {part['seconds']} s) |")
        elif record["benchmark"] == "attention_sweep":
            fp8 = " (fp8 KV cache)" if record.get("kv_cache_dtype", "auto") != "auto" else ""
            for row in record["rows"]:
                tiles, unit = row["tiles"], "TB/s" if "TB/s" in row else "TFLOP/s"
                splits = row.get("splits") or ("auto" if row["batch"].startswith("decode") else None)
                splits = f", {splits} splits" if splits else ""
                rows.append(f"| attention sweep{fp8} | {row['batch']}: {tiles['block_m']} x {tiles['tile_n']} tiles, "
                            f"{tiles['num_warps']} warps, {tiles['num_stages']} stages{splits} | "
                            f"{1000 * row['ms']:.1f} us, {row[unit]:.2f} {unit} |")
        elif record["benchmark"] == "gemm_shapes":
            steps: dict[tuple[str, int], list[dict]] = {}
            for row in record["rows"]:
                steps.setdefault((row["blas"], row["batch"]), []).append(row)
            for (blas, batch), matmuls in steps.items():
                each = ", ".join(f"{m['matmul']} {m['us']:.1f} us ({m['weight_TB/s']:.2f} TB/s)" for m in matmuls)
                total = sum(m["us"] * m["per_step"] for m in matmuls)
                rows.append(f"| gemm shapes | {blas}, batch {batch} | {total:,.0f} us per step: {each} |")
        elif record["benchmark"] == "latency":
            for row in record["rows"]:
                again = f", run {row['run'] + 1}" if row.get("run", 0) else ""  # --repeat's later runs
                fp8 = ", fp8 KV cache" if record.get("kv_cache_dtype", "auto") != "auto" else ""
                rows.append(f"| latency | batch {row['batch_size']}, prompt {record['prompt_len']}, "
                            f"output {record['output_len']}{fp8}{again} | TTFT {row['ttft_ms']:.1f} ms, "
                            f"TPOT {row['tpot_ms']:.2f} ms |")
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(results_table([line for line in f if line.strip()]))
