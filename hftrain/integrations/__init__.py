"""What hftrain talks to outside the run: the Hugging Face Hub (and S3) for sharing, SageMaker, experiment trackers,
network timeouts, and notebooks."""
