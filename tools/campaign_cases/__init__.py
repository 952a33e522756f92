"""The cases of ``tools/campaign.py``: bad inputs (:mod:`.refusals`) and faults (:mod:`.faults`), on a shared bench
(:mod:`.bench`)."""
