"""An HF Trainer script: a tiny BERT built from a config (no download), 4 steps on CPU."""

import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}


if __name__ == "__main__":
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=4,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_strategy="no",
        )
        Trainer(model=model, args=args, train_dataset=Tiny()).train()
    print("hf done")
