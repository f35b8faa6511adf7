"""Moving one cache file to or from one object: uploads (single PUT or multipart, lz4 framed
when it pays), ranged reads and verified downloads (`transfer`). It decides neither what nor
when: tiering and restore do.
"""
