#!/usr/bin/env bash
# The main job on bundled defaults: describe the bundled trained model and ask it for the next
# token after a records document and the instruction to repeat it (it should start copying:
# the document's first token, id 45 '-'). Grows into compaction as kvfold does.
set -euo pipefail
cd "$(dirname "$0")/.."
kvfold=${KVFOLD_BIN:-build/kvfold}
model=${KVFOLD_MODEL:-tests/data/records-qwen3}
"$kvfold" model-info "$model"
echo
# records-dev.jsonl document doc1-0 (16 records), then "Repeat the records above.\n"
ids=$(/usr/bin/env python3 -c '
import json,sys
d=json.loads(open(sys.argv[1]).readline())
print(",".join(map(str, d["ids"] + d["repeat_instruction_ids"])))' tests/data/records-dev.jsonl)
"$kvfold" logits --model "$model" --ids "$ids" --top 5
