"""The text of the SageMaker launcher that `hftrain launch-script RECIPE --kind sagemaker` writes (sagemaker.py
fills it in). It is plain SageMaker Python SDK v3 code, meant to be read and edited."""

LAUNCHER = '''#!/usr/bin/env python3
"""An hftrain recipe as an Amazon SageMaker training job. Written by: {command}

Needs `pip install 'hftrain[sagemaker]'` and AWS credentials from the standard AWS configuration (environment,
~/.aws, SSO). Run it from any directory: python THIS_FILE. It submits the job and returns; watch it in the
SageMaker console or with `aws sagemaker describe-training-job --training-job-name NAME`.

What the job does: SageMaker starts INSTANCE_COUNT x INSTANCE_TYPE with the AWS PyTorch training image,
installs hftrain's dependencies, and its torchrun driver starts `hftrain train RECIPE HYPERPARAMETERS` once
per GPU on every instance. The run directory is {checkpoints}, which SageMaker syncs to the checkpoint S3 URI;
on spot capacity an interrupted job is restarted with that directory restored and hftrain resumes from its
last checkpoint. The final model lands in /opt/ml/model, uploaded as model.tar.gz under the output path.
"""
import boto3
import tempfile

from sagemaker.core.helper.session_helper import Session
from sagemaker.core.shapes import MetricDefinition
from sagemaker.train import ModelTrainer
from sagemaker.train.configs import CheckpointConfig, Compute, InputData, SourceCode, StoppingCondition
from sagemaker.train.distributed import Torchrun

from hftrain.launch import sagemaker as hf

{settings}
# ROLE None: the SageMaker config's default execution role, else the role of the caller's credentials.
# REGION None: AWS_REGION / AWS_DEFAULT_REGION / ~/.aws/config. BUCKET None: the SDK's sagemaker-REGION-ACCOUNT.
# IMAGE None: the AWS PyTorch training image for INSTANCE_TYPE (hf.default_image, looked up offline).
# HYPERPARAMETERS: recipe overrides (dotted.key: value); ENVIRONMENT: the accelerate backend and the run directory;
# CHANNELS: SageMaker input channels (name: s3:// prefix), read in the recipe as channel:NAME.


def main() -> str:
    session = Session(boto_session=boto3.Session(region_name=REGION), default_bucket=BUCKET)
    bucket = session.default_bucket()
    with tempfile.TemporaryDirectory() as code:
        hf.stage_code(RECIPE, code)  # hftrain/, the recipe, requirements.txt, the entry script
        trainer = ModelTrainer(
            sagemaker_session=session,
            role=ROLE,
            base_job_name=JOB_NAME,
            training_image=IMAGE or hf.default_image(session.boto_region_name, INSTANCE_TYPE),
            source_code=SourceCode(source_dir=code, entry_script=hf.ENTRY_SCRIPT, requirements="requirements.txt"),
            distributed=Torchrun(),
            compute=Compute(instance_type=INSTANCE_TYPE, instance_count=INSTANCE_COUNT, volume_size_in_gb=VOLUME_GB,
                            enable_managed_spot_training=SPOT),
            stopping_condition=StoppingCondition(
                max_runtime_in_seconds=int(MAX_RUN_HOURS * 3600),
                max_wait_time_in_seconds=int(2 * MAX_RUN_HOURS * 3600) if SPOT else None,
            ),
            checkpoint_config=CheckpointConfig(
                s3_uri=f"s3://{{bucket}}/hftrain/{{JOB_NAME}}/checkpoints", local_path="{checkpoints}"
            ),
            hyperparameters=HYPERPARAMETERS,
            environment=ENVIRONMENT,
        ).with_metric_definitions([MetricDefinition(name=m["Name"], regex=m["Regex"]) for m in hf.METRIC_DEFINITIONS])
        channels = [InputData(channel_name=name, data_source=uri) for name, uri in CHANNELS.items()]
        trainer.train(input_data_config=channels or None, wait=False, logs=False)
    name = trainer._latest_training_job.training_job_name  # the SDK's documented way to reach the job
    print(f"submitted SageMaker training job {{name}} (checkpoints: s3://{{bucket}}/hftrain/{{JOB_NAME}}/checkpoints)")
    return name


if __name__ == "__main__":
    main()
'''
