"""Supervised helpers: SFT datums from chats, DPO and KTO losses."""
