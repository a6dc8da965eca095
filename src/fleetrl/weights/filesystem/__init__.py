"""The filesystem transport: the trainer writes a version as verified shards on storage every
worker reads. Its wire records, its on-disk format, and the sender and receiver sides."""
