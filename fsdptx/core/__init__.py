"""Pure building blocks: tree walks, dtypes, policies, chunks, argument checks, meshes, globs.

The lowest layer: imports nothing else from fsdptx."""
