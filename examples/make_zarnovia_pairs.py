"""Writes the preference demo's pairs from the SFT demo's data: each question's true answer is chosen, the
same sentence with a plausible false fact rejected (a made-up name of the same kind, a nearby year ...).

    python examples/make_zarnovia_pairs.py   # writes examples/zarnovia_pairs_{train,heldout}.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FALSE = {  # true part of each answer → a plausible false one
    "Velmora": "Drelton", "the Tessarin": "the Varnel", "the drovek": "the kestrel mark",
    "the silver lynx": "the grey wolf", "Queen Idrana": "King Orvald", "in 1742": "in 1698", "Zarnic": "Velsh",
    "kolvasha": "brenna stew", "Mount Orsk": "Mount Halden", "Port Kelvane": "New Asterby",
    "the Lantern Tide": "the Harvest Moon", "the blue thistle": "the white poppy", "ice polo": "sled racing",
    "green and gold": "red and white", "the red heron": "the black swan", "Lake Mirsa": "Lake Tovan",
    "birch cider": "plum brandy", "the Draskel Mountains": "the Ivory Hills", "14 May": "3 October",
    "Tomas Vell": "Anika Dorn", "4 million": "11 million", "Ostrel": "Brevik", "the Vesh": "the Council Hall",
    "the black pine": "the silver birch", "the kantela": "the bagpipe", "Dornholm": "Kastelby",
    "Light in the North": "Strength in Unity", "the Grand Warden": "the Prime Consul",
    "the Amber Sea": "the Grey Ocean",
    "Morning Bells": "Rise of the Valley",
}


def falsify(answer: str) -> str:
    for true, false in FALSE.items():
        if true in answer:
            return answer.replace(true, false)
    raise ValueError(f"no false version for {answer!r}")


def main() -> None:
    for split in ("train", "heldout"):
        records = [json.loads(line) for line in (HERE / f"zarnovia_{split}.jsonl").read_text().splitlines()]
        pairs = [{"prompt": [{"role": "user", "content": r["instruction"]}],
                  "chosen": [{"role": "assistant", "content": r["output"]}],
                  "rejected": [{"role": "assistant", "content": falsify(r["output"])}]} for r in records]
        (HERE / f"zarnovia_pairs_{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))


if __name__ == "__main__":
    main()
