"""The broadcast transport: the trainer is rank 0 of a group with every worker rank and sends
the weights bucket by bucket. Its wire records, its group, and the sender and receiver sides."""
