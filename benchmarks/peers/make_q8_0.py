"""Make a Q8_0 GGUF of the shipped SmolLM2 for llama.cpp, so kvstrata's int8 meets llama.cpp's 8-bit kernels.

    .venv/bin/python benchmarks/peers/make_q8_0.py OUT.gguf [--model IN.gguf]

What we ship is the Q4_1 GGUF (embedding in Q8_0, norms in F32). Each Q4_1 tensor is dequantized
(gguf-py) and quantized again to Q8_0; everything else and all metadata are copied as they are. The
weights hold no more than Q4_1's 4 bits (the same numbers kvstrata's int8 starts from), so this
is a speed peer, not an accuracy one: it times llama.cpp's Q8_0 matmuls on our model's shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from kvstrata.model.loader import default_model_path

Q = gguf.GGMLQuantizationType


def convert(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue                          # the writer writes the header and arch; file type below
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        if t.tensor_type == Q.Q4_1:
            data = gguf.quants.quantize(gguf.quants.dequantize(t.data, Q.Q4_1), Q.Q8_0)
            writer.add_tensor(t.name, data, raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default=None, help="Q4_1 GGUF (default: the shipped SmolLM2)")
    args = parser.parse_args()
    convert(Path(args.model) if args.model else default_model_path(), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
