# Source: shared/seeds/003_6620941ba6850c55.txt (MindSpeed migration guide for Megatron-LM GPT),
# lines 194-262: the single-node script pretrain_single.sh ("单机多卡训练", step 1), printed as a
# ```shell block (lines 193-263). Verbatim below this header (so the guide's "#!/bin/bash" is line 11
# here, not line 1: run it with bash, not ./). Reference only: it launches Megatron-LM's
# pretrain_gpt.py with torchrun, not this project. Verbatim defect kept: the line
# "    --hidden-size 1024 \ " has a space after the backslash, so inside the double-quoted GPT_ARGS the
# backslash is not a line continuation and a lone "\" word lands between "1024" and
# "--num-attention-heads" when $GPT_ARGS is word-split. The guide's other variants, not here:
# pretrain_distributed.sh (lines 313-381: 2 nodes, --global-batch-size 128) and the resume variant
# (lines 509-578: adds --load $CHECKPOINT_PATH; its OUTPUT_ARGS is a bash array passed as
# $OUTPUT_ARGS, which expands to the first element only).
#!/bin/bash

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8 # 每个节点卡数，根据实际情况填写
# Change for multinode config
MASTER_ADDR=localhost # 单机默认localhost，多机填写主节点ip
MASTER_PORT=6000
NNODES=1 # 节点数，单机情况填写1
NODE_RANK=0 # 节点rank，主节点填写0
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=./ckpt
VOCAB_FILE=./gpt-tokenizer/gpt2-vocab.json # 数据集准备章节步骤1下载的文件，根据实际路径填写
MERGE_FILE=./gpt-tokenizer/gpt2-merges.txt # 数据集准备章节步骤1下载的文件，根据实际路径填写
DATA_PATH=./gpt_pretrain_data/alpaca_text_document # gpt_pretrain_data为数据集准备章节步骤4生成的文件路径，alpaca_text_document为bin和idx文件的共同前缀

# 分布式节点参数
DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT \
"

# GPT模型参数
GPT_ARGS="
    --num-layers 24 \
    --hidden-size 1024 \ 
    --num-attention-heads 16 \
    --seq-length 1024 \
    --max-position-embeddings 1024 \
    --micro-batch-size 8 \
    --global-batch-size 64 \
    --lr 0.00015 \
    --train-iters 1000 \
    --lr-decay-iters 320000 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0 \
    --fp16 \
    --transformer-impl local \
"

# 数据集配置
DATA_ARGS="
    --data-path $DATA_PATH \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --split 949,50,1 \
"

OUTPUT_ARGS="
    --log-interval 100 \
    --save-interval 100 \
    --eval-interval 1000 \
    --eval-iters 10
"

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl \
    --save $CHECKPOINT_PATH \
    --ckpt-format torch
