"""The data of a run, from files to the tensors of each forward pass.

    read       records from JSON Lines / JSON files (sources: what the ``datasets`` library reads)
    sft, pairs the record forms of the objectives, checked and tokenized (chat: chat rendering)
    tokenize   a file's records → a tokenized Dataset, through the token cache (cache)
    batch      the seeded sampler, and each rank's forward passes of a global batch (pack: --packing)
    checks     warnings about data that will not do what the user thinks
    records    the types all of them share
"""
