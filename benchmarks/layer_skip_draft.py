"""A draft model made from the target itself: the first N transformer blocks of a GGUF model with
the target's embedding, final norm and head (self-speculative decoding, as in Zhang et al. 2023,
"Draft & Verify"). It shares the target's tokenizer by construction, which is why it serves as the
draft model of bench_spec.py where no smaller model of the same family ships.

    python benchmarks/layer_skip_draft.py SRC.gguf DST.gguf --layers 8

Tensors are copied in their stored (quantised) form; only the block count changes in the metadata.
"""
from __future__ import annotations

import argparse

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def write_layer_skip_draft(src: str, dst: str, num_layers: int) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    block_count_key = f"{arch}.block_count"
    total = int(reader.fields[block_count_key].contents())
    if not 1 <= num_layers < total:
        raise ValueError(f"--layers must be in 1..{total - 1} for a {total}-block model, got {num_layers}")
    writer = GGUFWriter(dst, arch)  # writes general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header fields are the writer's own
        value = num_layers if name == block_count_key else field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers)]
    for t in kept:  # the stored bytes' shape; the writer derives the element shape from the type
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    write_layer_skip_draft(args.src, args.dst, args.layers)


if __name__ == "__main__":
    main()
