"""PyTorch Distributed Checkpoint (DCP) folders, read and written without torch.

A DCP checkpoint is a folder: ``.metadata`` (one pickle, written last: its presence marks a complete
save) and data files ``__<rank>_<k>.distcp``. The metadata lists, per state-dict key (fqn), either a
tensor (dtype, global shape, and its *chunks*: boxes of the global tensor given by offsets and sizes,
any number, uneven, each stored once) or a non-tensor value saved as opaque ``torch.save`` bytes; and,
per chunk or value, where its bytes are (relative file, byte offset, length, stream transforms).

Why no ``pickle.load``: a pickle can run any code, and these files come from users. Both pickles DCP
uses are read by unpicklers whose ``find_class`` allows exactly the globals DCP (and ``torch.save``)
name and maps each to an inert stand-in; any other global is refused with one ``FormatError`` naming
the file and the global, before anything runs. The stand-ins become plain frozen records
(``DcpMetadata``, ``TensorMeta``, ``BytesItem``) after validation: every chunk inside its tensor,
chunks neither overlapping nor leaving a gap, every stored item inside an existing file.

Why columns: a checkpoint saved by thousands of ranks has tens of millions of chunks (4,096 ranks x
5,000 fully sharded parameters: 20 M). One Python object per chunk, built and checked one by one,
cost some 20 us each. So each tensor's chunks are a ``ChunkTable`` (numpy columns: offsets, sizes,
file, byte offset, length), filled from the unpickler's records in bulk, and every check runs on whole
columns; ``TensorMeta.chunks`` (``Chunk`` records) is built only when asked for. The C unpickler is
fed in blocks (``_PickleInput``), the allowed classes keep their pickled state without a ``__dict__``,
and the cycle collector is paused while the records exist. ``docs/pytorch.md`` has the figures.

A chunk's bytes come in one of torch's two serializations, told apart by what starts at the item's
offset: ``torch_save`` (the default) stores each chunk as a complete ``torch.save`` ZIP archive whose
``data.pkl`` rebuilds the tensor from storage member ``data/<key>``, stored uncompressed, so its raw
little-endian bytes can be found and handed out in place; ``safetensors`` makes each file a
safetensors blob (after any non-tensor values) holding one chunk per fqn, with ``DCP_SHARDING_INFO``
naming each chunk's offsets. ``index_distcp`` gives, per data file, a ``TensorIndex`` like every other
reader's (one entry per chunk, named ``chunk_name(fqn, offsets)``, zero-copy over a memory map), so the
executors copy chunk bytes as they copy any tensor. Non-tensor values are never unpickled: they are
byte ranges to carry. Stream transforms (``transform_descriptors``, e.g. zstd) are refused.

Writing (``distcp_layout`` + ``distcp_finish``, or ``save_dcp`` for values in memory) uses the
``torch_save`` serialization: it is what ``FileSystemReader`` of torch 2.13 loads (it cannot load its
own ``safetensors`` serialization: it hands every tensor item to ``torch.load``). Each chunk is a ZIP
archive with the members torch writes (``data.pkl`` emitted opcode by opcode naming torch's globals,
``data/0`` aligned to 64 bytes, ``version``, ``byteorder``, ...), laid out before any data exists so the
executor fills ``data/0`` in place; the CRC-32 of each ``data/0`` is patched in afterwards. ZIP64
records are used for members or archives past 4 GiB, as torch does. ``write_metadata`` writes the
``.metadata`` pickle (the same globals torch's has) to ``.metadata.tmp`` and renames it, last.

The package: ``names`` (file and serialization names, no numpy), ``records`` (the plain values),
``unpickling`` (the allowlisting unpicklers), ``opcodes`` (every opcode of a pickle checked against
what the file can hold, before it is unpickled), ``metadata`` (reading and checking ``.metadata``),
``data`` (reading ``.distcp`` files) and ``write`` (the writer); everything public is importable from
``reshard.formats.dcp`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard import lazy

if TYPE_CHECKING:  # where each name lives: a type checker imports them; at run time reshard.lazy reads this
    from reshard.formats.dcp.data import index_distcp, open_distcp, read_bytes_item, serialization_of
    from reshard.formats.dcp.metadata import check_chunks, read_dcp_metadata
    from reshard.formats.dcp.names import (
        DATA_SUFFIX,
        DCP_VERSION,
        FORMAT,
        METADATA_NAME,
        NO_METADATA,
        SAFETENSORS,
        TORCH_SAVE,
        UNFINISHED,
    )
    from reshard.formats.dcp.records import (
        BytesItem,
        Chunk,
        ChunkTable,
        DcpMetadata,
        TensorMeta,
        chunk_name,
        collector_paused,
    )
    from reshard.formats.dcp.write import (
        ChunkSpec,
        DistcpLayout,
        archive_size,
        bytes_name,
        distcp_finish,
        distcp_layout,
        metadata_pickle,
        patch_crc,
        save_dcp,
        tensor_pickle,
        tensors_of,
        write_distcp,
        write_metadata,
    )

__getattr__, __dir__ = lazy.exports(globals())  # each name's module, from the block above, loads on first use

__all__ = [
    "DATA_SUFFIX",
    "DCP_VERSION",
    "FORMAT",
    "METADATA_NAME",
    "NO_METADATA",
    "SAFETENSORS",
    "TORCH_SAVE",
    "UNFINISHED",
    "BytesItem",
    "Chunk",
    "ChunkSpec",
    "ChunkTable",
    "DcpMetadata",
    "DistcpLayout",
    "TensorMeta",
    "archive_size",
    "bytes_name",
    "check_chunks",
    "chunk_name",
    "collector_paused",
    "distcp_finish",
    "distcp_layout",
    "index_distcp",
    "metadata_pickle",
    "open_distcp",
    "patch_crc",
    "read_bytes_item",
    "read_dcp_metadata",
    "save_dcp",
    "serialization_of",
    "tensor_pickle",
    "tensors_of",
    "write_distcp",
    "write_metadata",
]
